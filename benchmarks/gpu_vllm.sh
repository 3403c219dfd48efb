#!/usr/bin/env bash
# Device check: kvevict's policies in vLLM's CPU offload tier, end to end, on a CUDA GPU.
#
# On a GPU machine it installs the CUDA build of vLLM 0.32 (pip, from the registry) in its own
# venv, builds a small random Llama from a config (no download), and replays one scripted
# multi-session trace through LLM() twice: with vLLM's OffloadingConnector running kvevict's
# `lru` and then `market` (kvevict.adapters.vllm.offload.KVEvictCachePolicy). The GPU pool is
# kept small (num_gpu_blocks_override) so that prefixes fall out of the GPU tier and come back
# from the CPU tier, and the CPU tier is small too, so that its eviction policy matters. Per
# policy it prints vLLM's prefix-cache counters (GPU tier and connector) and TTFT (vLLM's
# histogram mean, and the p50/p95 of each request's own wall time with max_tokens=1). Budget:
# well inside 10 minutes after the install (two engine starts of about 30 s each, 160 short
# requests each).
#
#   benchmarks/gpu_vllm.sh              # on the GPU machine (installs, then runs)
#   benchmarks/gpu_vllm.sh --dry-run    # on CPU, in the vLLM CPU venv: every part that can
#                                       # run without a GPU (see below)
#
# --dry-run (what a CPU machine can check): the workload and the model are built; the offload
# tier's two policies replay the workload's exact block-key stream through vLLM's real
# CPUOffloadingManager (no engine: vLLM's CPU platform refuses the OffloadingConnector); the
# connector config is validated by vLLM's own KVTransferConfig; and the driver itself runs
# LLM() on CPU once without the connector, so the request loop, the metrics and the TTFT
# report are exercised.
#
# Environment: VENV (default /tmp/venv-vllm-cuda; --dry-run: /work/venv-vllm or $VENV),
# PYTHON (default python3.11), VLLM_SPEC (default "vllm==0.32.*").
set -euo pipefail

DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "gpu_vllm.sh: unknown argument $arg (expected --dry-run)" >&2; exit 2 ;;
  esac
done

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3.11}"
WORK="$(mktemp -d /tmp/kvevict-gpu-vllm.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT

if [ "$DRY" = 1 ]; then
  VENV="${VENV:-/work/venv-vllm}"
  [ -x "$VENV/bin/python" ] || { echo "--dry-run needs a vLLM venv at $VENV (docs/vllm.md)" >&2; exit 2; }
else
  VENV="${VENV:-/tmp/venv-vllm-cuda}"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader \
    || { echo "no GPU (nvidia-smi): run with --dry-run on CPU" >&2; exit 2; }
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q "${VLLM_SPEC:-vllm==0.32.*}"
  fi
  "$VENV/bin/pip" install -q -e "$ROOT" --no-deps
  "$VENV/bin/pip" install -q "attrs>=23" "numpy>=1.24" sortedcontainers
fi
PY="$VENV/bin/python"
"$PY" -c "import vllm, kvevict.adapters.vllm as a; print('vLLM', vllm.__version__); a.check_vllm_version()"

cat > "$WORK/driver.py" <<'EOF'
"""Build the model and workload; run LLM() with one offload policy (or check on CPU)."""
import json, os, random, statistics, sys, time

BLOCK = 16          # GPU block size (tokens); the CUDA attention backends take 16
GPU_BLOCKS = 96     # usable GPU KV blocks: ~4 sessions' prefixes; the rest must come from CPU
CPU_BLOCKS = 160    # CPU offload tier, in GPU blocks (chunk = one block)
HEADS, HEAD_DIM, LAYERS = 8, 64, 8


def build_model(path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=HEADS * HEAD_DIM, intermediate_size=1536,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=HEADS, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)


def workload():
    """16 chat sessions over 2 shared system prompts, 10 turns each, interleaved round-robin
    with one-shot prompts between turns: 160 session requests + 40 one-shots."""
    rnd = random.Random(14)
    toks = lambda n: [rnd.randrange(1, 8192) for _ in range(n)]
    systems = [toks(256), toks(256)]
    sessions = [systems[s % 2] + toks(64) for s in range(16)]
    prompts = []
    for turn in range(10):
        for s in range(16):
            prompts.append(list(sessions[s]))
            sessions[s] += toks(48)
            if s % 4 == 3:
                prompts.append(toks(320))
    return prompts


def chunk_bytes():
    return 2 * LAYERS * HEADS * HEAD_DIM * 2 * BLOCK  # K and V, bf16


def extra_config(policy):
    return {"cpu_bytes_to_use": CPU_BLOCKS * chunk_bytes(),
            "eviction_policy": "KVEvictCachePolicy",
            "cache_policy_module_path": "kvevict.adapters.vllm.offload",
            "kvevict_policy": policy, "kvevict_policy_params": {}}


def run_engine(model, prompts, policy):
    from vllm import LLM, SamplingParams
    kwargs = dict(model=model, skip_tokenizer_init=True, enable_prefix_caching=True,
                  enforce_eager=True, max_model_len=2048, block_size=BLOCK,
                  num_gpu_blocks_override=GPU_BLOCKS + 1, disable_log_stats=False, seed=0)
    if policy == "none":  # the CPU dry run: no connector (vLLM's CPU platform refuses it)
        kwargs.update(dtype="float32", gpu_memory_utilization=0.1, block_size=32,
                      num_gpu_blocks_override=2048 // 32 + 1)
    else:
        from vllm.config import KVTransferConfig
        kwargs.update(dtype="bfloat16", gpu_memory_utilization=0.5,
                      kv_transfer_config=KVTransferConfig(
                          kv_connector="OffloadingConnector", kv_role="kv_both",
                          kv_connector_extra_config=extra_config(policy)))
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start = time.perf_counter() - t0
    params = SamplingParams(max_tokens=1, temperature=0)
    walls = []
    for p in prompts:
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        walls.append(time.perf_counter() - t)
    m = {}
    for x in llm.get_metrics():
        if "prefix_cache" in x.name:
            m[x.name] = x.value
        elif x.name == "vllm:time_to_first_token_seconds":
            m["ttft_mean_s"] = x.sum / x.count if x.count else None
    walls.sort()
    m["ttft_wall_p50_s"] = statistics.median(walls)
    m["ttft_wall_p95_s"] = walls[int(0.95 * (len(walls) - 1))]
    m["engine_start_s"] = start
    m["requests"] = len(prompts)
    return m


def offload_keys_replay(prompts, policy):
    """The workload's offload keys (vLLM's own block hashes) through vLLM's real
    CPUOffloadingManager with the policy: the offload tier's side of the run, no engine."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from kvevict.adapters.vllm.gpu_replay import block_hasher
    from kvevict.adapters.vllm.replay import drive_request, make_manager
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    hasher = block_hasher(BLOCK)
    manager, _ = make_manager(policy, CPU_BLOCKS, chunk_tokens=BLOCK)
    hits = looked = 0
    for i, p in enumerate(prompts):
        req = Request(str(i), p, SamplingParams(max_tokens=1), None, block_hasher=hasher)
        keys = [make_offload_key(bytes(h), 0) for h in req.block_hashes]
        found, _ = drive_request(manager, keys, ReqContext(str(i)), BLOCK)
        hits += found
        looked += len(keys)
    return {"offload_chunk_hits": hits, "offload_chunk_lookups": looked}


if __name__ == "__main__":
    mode, work = sys.argv[1], sys.argv[2]
    model = os.path.join(work, "llama")
    if not os.path.isdir(model):
        build_model(model)
    if mode == "build":
        sys.exit(0)
    prompts = workload()
    if mode == "dry":
        from vllm.config import KVTransferConfig
        for policy in ("lru", "market"):
            KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                             kv_connector_extra_config=extra_config(policy))
            print(json.dumps({"policy": policy, "tier": "offload (CPUOffloadingManager)",
                              **offload_keys_replay(prompts, policy)}))
        print(json.dumps({"policy": "none (GPU tier only, CPU engine)",
                          **run_engine(model, prompts[:24], "none")}))
    else:
        print(json.dumps({"policy": mode, **run_engine(model, prompts, mode)}))
EOF

if [ "$DRY" = 1 ]; then
  PYTHONPATH="$ROOT" timeout 600 "$PY" "$WORK/driver.py" dry "$WORK" 2>"$WORK/err.log" \
    || { tail -40 "$WORK/err.log" >&2; exit 1; }
  exit 0
fi
"$PY" "$WORK/driver.py" build "$WORK" 2>"$WORK/build.log" \
  || { tail -20 "$WORK/build.log" >&2; exit 1; }
for policy in lru market; do
  timeout 280 "$PY" "$WORK/driver.py" "$policy" "$WORK" 2>"$WORK/$policy.log" \
    || { echo "policy $policy failed:" >&2; tail -40 "$WORK/$policy.log" >&2; exit 1; }
done
