"""Reference models, workloads and baselines of ../shared/BENCHMARKS.md, shared by the benchmark scripts."""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.environ.get("PAGEDSERVE_RESULTS_DIR") or os.path.join(HERE, "results")  # gpu_check.sh: $OUT
MODELS = os.path.join(HERE, ".models")

REFERENCE_MODELS = {
    "bench-llama-58m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                            intermediate_size=1376, vocab_size=32000),
    "bench-llama-gqa": dict(hidden_size=768, num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=4,
                            intermediate_size=2048, vocab_size=32000),
    "bench-llama-7b-shape": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                 num_key_value_heads=32, intermediate_size=11008, vocab_size=32000),
    # Qwen2.5-0.5B's config.json (q/k/v biases, tied embeddings).
    "bench-qwen2-0.5b-shape": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                                   tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                   use_sliding_window=False),
    # Llama-3.2-1B's config.json (tied embeddings, llama3 rope scaling).
    "bench-llama-1b-shape": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                 head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                                 rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=16384,
                                 rope_scaling=dict(rope_type="llama3", factor=32.0, high_freq_factor=4.0,
                                                   low_freq_factor=1.0, original_max_position_embeddings=8192)),
}
# The MoE reference shapes (bench_moe.py; the dense benchmarks' FLOP and byte counts do not cover experts).
MOE_REFERENCE_MODELS = {
    # Qwen3-30B-A3B's MoE layer (128 experts, top-8, expert width 768), 4 layers.
    "bench-qwen3-moe-shape": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=4,
                                  num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                                  moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                  norm_topk_prob=True, vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6),
    # gpt-oss's expert layout (32 experts, top-4) built as Qwen3-MoE.
    "bench-moe-32x4": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=6, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=64, intermediate_size=8192, moe_intermediate_size=2048,
                           num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, vocab_size=32000),
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# The context length reference models are saved with unless they name one (the real 0.5B/1B configs say 32K/128K;
# llama3 rope needs more than its 8K original): neither engine then sizes anything for contexts no workload reaches.
MAX_POSITIONS = 4096


def reference_model(name: str) -> str:
    """Build (once) a random-weight reference model dir with transformers and return its path. Weights are saved
    in bf16, as real checkpoints are; a dir saved in another dtype is rebuilt (into a new dir, then swapped in)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.path.join(MODELS, name)
    if _saved_dtype(path) == "bfloat16":
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):  # a dir built before tokenizers were added
            word_tokenizer(_spec(name)["vocab_size"]).save_pretrained(path)
        return path
    torch.manual_seed(0)
    spec = _spec(name)
    model_type = spec.pop("model_type", "llama")
    spec.setdefault("tie_word_embeddings", False)
    spec.setdefault("max_position_embeddings", MAX_POSITIONS)
    config = AutoConfig.for_model(model_type, **spec)
    config.architectures = [ARCHITECTURES[model_type]]
    big = name.endswith("7b-shape")  # build on the GPU
    with torch.device("cuda" if big and torch.cuda.is_available() else "cpu"):
        # The MoE shapes' billions of parameters are drawn in bf16 (half the memory of fp32 and a cast).
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if model_type == "qwen3_moe" else None)
    tmp = f"{path}.building-{os.getpid()}"
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    word_tokenizer(config.vocab_size).save_pretrained(tmp)
    if os.path.isdir(path):  # processes still reading the old files keep them open until they finish
        shutil.rmtree(path)
    os.rename(tmp, path)
    return path


def _spec(name: str) -> dict:
    return dict(REFERENCE_MODELS.get(name) or MOE_REFERENCE_MODELS[name])


def _saved_dtype(path: str) -> str | None:
    """The dtype a model dir's weights were saved in (None when there is no complete dir)."""
    has_weights = os.path.isfile(os.path.join(path, "model.safetensors")) or os.path.isfile(
        os.path.join(path, "model.safetensors.index.json"))
    if not has_weights or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("dtype") or cfg.get("torch_dtype")


def word_tokenizer(vocab_size: int):
    """A tokenizer for random-weight models: one word per id ("w3" .. "w31999"), so any id detokenizes and the
    gateway (which deals in text too) can serve the reference models."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def num_params(model_dir: str) -> int:
    from safetensors import safe_open

    total = 0
    for f in os.listdir(model_dir):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, f), "pt") as st:
                total += sum(int(np.prod(st.get_slice(k).get_shape())) for k in st.keys())
    return total


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def _lognormal(rng: np.random.Generator, n: int, mean: float, lo: int, hi: int, sigma: float = 0.8) -> list[int]:
    mu = np.log(mean) - sigma**2 / 2
    return np.clip(np.round(rng.lognormal(mu, sigma, n)), lo, hi).astype(int).tolist()


def make_workload(name: str, vocab: int = 32000, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    if name == "sharegpt":
        ins, outs = _lognormal(rng, 256, 160, 4, 1024), _lognormal(rng, 256, 160, 4, 512)
    elif name == "alpaca":
        ins, outs = _lognormal(rng, 512, 20, 4, 1024), _lognormal(rng, 512, 60, 4, 512)
    elif name == "shared-prefix":
        system = rng.integers(3, vocab, 512).tolist()
        prompts = [system + rng.integers(3, vocab, int(rng.integers(32, 129))).tolist() for _ in range(128)]
        return Workload(name, prompts, [64] * 128)
    else:
        raise ValueError(f"unknown workload {name}")
    return Workload(name, [rng.integers(3, vocab, n).tolist() for n in ins], outs)


def matmul_peak_flops(dtype=torch.float32, n: int = 1024, device: str = "cpu", repeat: int = 5) -> float:
    """The best FLOP/s of a square matmul: the physical limit the model's FLOP utilization is measured against.
    On CPU also oneDNN's prepacked linear at n and 2n, and the best counts: fp32 ``torch.matmul`` (MKL) can run
    far below oneDNN, and against it alone fp32 MFU passed 100%."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    calls = [(n, lambda: a @ b)]
    if device == "cpu" and torch.backends.mkldnn.is_available():
        for m in (n, 2 * n):
            x, w = torch.randn(m, m, dtype=dtype), torch.randn(m, m, dtype=dtype)
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
            except RuntimeError:  # no oneDNN kernel for this dtype here
                break
            calls.append((m, lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")))
    best = 0.0
    for m, call in calls:
        for _ in range(repeat):
            t = time.perf_counter()
            for _ in range(3):
                call()
            if device == "cuda":
                torch.cuda.synchronize()
            best = max(best, 3 * 2 * m**3 / (time.perf_counter() - t))
    return best


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break
    except OSError:
        pass
    return fields


def cpu_description() -> str:
    """The CPU as /proc/cpuinfo and sysfs name it, e.g. "AMD EPYC (family 25 model 17), L1d 32K": this project's
    machines of one kind have been Zen 4 and Zen 5 EPYCs and Xeons, whose rates differ 2x."""
    fields = _cpuinfo()
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index0/size") as f:
            l1d = f.read().strip()
    except OSError:
        return platform.processor() or platform.machine()
    family, model = fields.get("cpu family", "?"), fields.get("model", "?")
    return f"{fields.get('model name', '?')} (family {family} model {model}), L1d {l1d}"


_INTEL_CORES = {85: "skx", 106: "icx", 143: "spr", 173: "gnr", 175: "srf", 207: "emr"}  # family 6 server models


def cpu_slug(model_name: str | None = None, family: int | None = None, model: int | None = None) -> str:
    """The machine kind a results file is named after, from the CPU model: "epyc-zen4", "epyc-zen5", "xeon-spr";
    "<brand>-f<family>m<model>" for a core not listed here. Defaults to this machine's CPU."""
    if model_name is None:
        fields = _cpuinfo()
        model_name = fields.get("model name", platform.machine())
        family = int(fields["cpu family"]) if fields.get("cpu family", "").isdigit() else None
        model = int(fields["model"]) if fields.get("model", "").isdigit() else None
    name = model_name.lower()
    brand = next((b for b in ("epyc", "xeon", "ryzen", "core", "amd", "intel") if b in name),
                 re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "cpu")
    core = None
    if family is not None and model is not None:
        if "amd" in name or brand in ("epyc", "ryzen"):
            core = {23: "zen2" if model >= 0x30 else "zen1", 26: "zen5",
                    25: "zen4" if 0x10 <= model <= 0x1F or model >= 0x60 else "zen3"}.get(family)
        elif family == 6:
            core = _INTEL_CORES.get(model)
        core = core or f"f{family}m{model}"
    return f"{brand}-{core}" if core else brand


def machine_slug(device: str = "cpu") -> str:
    """The CPU's slug, or on CUDA the GPU's name as a slug ("nvidia-h100-80gb-hbm3")."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    return cpu_slug()


def results_path(name: str, ext: str, device: str = "cpu") -> str:
    """benchmarks/results/<name>-<machine slug>.<ext>: one file per benchmark per machine kind."""
    return os.path.join(RESULTS, f"{name}-{machine_slug(device)}.{ext}")


def git_commit() -> str:
    """The checkout's HEAD, short, with "+dirty" for uncommitted changes; "" where it is no git checkout."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty=+dirty"], cwd=HERE, capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def save_results(name: str, data: dict) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    data = {"date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
            "machine": f"{platform.machine()} {os.cpu_count()} cores", "cpu": cpu_description(),
            "torch": torch.__version__, **data}
    path = results_path(name, "json", str(data.get("device", "cpu")))
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    return path
