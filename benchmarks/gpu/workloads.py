"""The GPU benchmark's workloads: what each builds and how one step runs.

A workload is a ``Spec`` (its name, the modules it needs, its step counts, the
size knob the largest-batch search turns) and a builder. A builder returns a
``Runner``:

- ``draw(rng)``: the next step's shape (a dict of ints) from a seeded
  ``random.Random``, so both allocators see the same sequence;
- ``worst()``: the largest shape the size allows; each probe of the batch
  search ends with it, after the drawn shapes have left the cache fragmented;
- ``step(shape)``: one training step, inference request or generate() call.

Models come from small ``transformers`` configs with random weights (nothing is
downloaded). Every builder has a full configuration for the GPU and a tiny one
(``smoke=True``) that runs a step in well under a second on a CPU, so the whole
harness is tested without a GPU. ``alloc_speed`` is the one workload that is not
a sequence of steps: ``alloc_speed()`` times ``torch.empty`` pairs itself.
"""
from __future__ import annotations

import itertools
import math
import random
import statistics
import threading
import time
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

Shape = Dict[str, int]


@dataclass
class Runner:
    """One built workload: see the module docstring."""

    draw: Callable[[random.Random], Shape]
    worst: Callable[[], Shape]
    step: Callable[[Shape], None]
    params: int
    config: Dict[str, Any]


@dataclass(frozen=True)
class Spec:
    """A workload as the harness sees it."""

    name: str
    title: str
    kind: str  # "steps" or "micro"
    requires: Tuple[str, ...]  # importable modules besides torch
    size: int  # the knob's value in the timed runs (batch, or the largest batch drawn)
    size_name: str  # what the knob is, for tables
    search_start: int  # the batch search's first probe: near the answer under a 40 GiB budget saves probes
    search_hi: int  # the batch search never probes above this
    steps: int
    quick_steps: int
    warmup: int
    trace: bool  # record its native memory history for the replay benchmark
    trace_steps: int = 0  # steps in that recording: enough to show the pattern, few enough to stay small
    probe_steps: int = 6  # drawn steps in each batch-search probe, before the worst shape twice
    build: Optional[Callable[[torch.device, int, bool], Runner]] = None
    smoke_size: int = 2
    # Allocators it runs under besides the default ones when --allocators is not given.
    extra_allocators: Tuple[str, ...] = ()


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()


def _train_step(model, optimizer, autocast: Optional[torch.dtype], device: torch.device, **inputs) -> None:
    with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        loss = model(**inputs).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------
# 1. Allocation speed through torch
# ---------------------------------------------------------------------------

KiB, MiB = 1 << 10, 1 << 20


def mixed_sizes(n: int, lo: int, hi: int, seed: int) -> List[int]:
    """n sizes log-uniform in [lo, hi] bytes."""
    rng = random.Random(seed)
    a, b = math.log2(lo), math.log2(hi)
    return [int(2 ** rng.uniform(a, b)) for _ in range(n)]


def _pair_loop(empty: Callable[[int], torch.Tensor], sizes: List[int], pairs: int, live: int) -> Tuple[float, float]:
    """Runs `pairs` torch.empty + release; with live > 0 the last `live` tensors stay alive."""
    cycle = itertools.islice(itertools.cycle(sizes), pairs)
    start = time.perf_counter()
    if live == 0:
        for n in cycle:
            empty(n)
    else:
        ring: List[Optional[torch.Tensor]] = [None] * live
        for i, n in enumerate(cycle):
            ring[i % live] = empty(n)  # frees the tensor `live` pairs older
        ring.clear()
    return start, time.perf_counter()


def _timed_pairs(device: torch.device, sizes: List[int], pairs: int, live: int, threads: int) -> float:
    """Wall-clock ns per pair seen by each thread (all threads start together)."""

    def empty(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, device=device)

    if threads == 1:
        start, end = _pair_loop(empty, sizes, pairs, live)
        return (end - start) * 1e9 / pairs
    barrier = threading.Barrier(threads)
    spans: List[Tuple[float, float]] = []

    def work(offset: int) -> None:
        mine = sizes[offset:] + sizes[:offset]  # the threads do not ask for the same sizes in step
        barrier.wait()
        spans.append(_pair_loop(empty, mine, pairs, live))

    pool = [threading.Thread(target=work, args=(i * len(sizes) // threads,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return (max(e for _, e in spans) - min(s for s, _ in spans)) * 1e9 / pairs


#: alloc_speed's processes per allocator, alternated in rounds (--rounds overrides):
#: the first H200 runs showed that one process is not enough, pyalloc's per-pair time
#: changing 2x from one process to the next while native's stayed put.
SPEED_ROUNDS = {"smoke": 2, "quick": 3, "full": 5}
#: Timed repeats of each case in one process (their median is the process's figure),
#: each paired with a repeat of the torch.empty(0) baseline.
SPEED_REPEATS = {"smoke": 2, "quick": 5, "full": 9}


def speed_mode(smoke: bool, quick: bool) -> str:
    return "smoke" if smoke else "quick" if quick else "full"


def alloc_speed_cases(smoke: bool, quick: bool, seed: int) -> List[Dict[str, Any]]:
    """The cases of workload 1: (name, sizes, pairs per thread, live tensors, threads).

    A repeat should last 10-30 ms with --quick: an estimate from the pair counts and
    the 2.3-4.5 us a torch.empty pair the H200 runs of 2026-11-28 measured, not yet a
    measured figure. One process then measures in about a second, and its start
    (python, torch, the CUDA context) costs more than that, so more processes, not
    longer ones, buy precision.
    """
    top = 64 * KiB if smoke else 256 * MiB
    mixed = mixed_sizes(64 if smoke else 4096, 512, top, seed)
    one = 200 if smoke else (4_000 if quick else 20_000)
    few = 200 if smoke else (1_000 if quick else 4_000)  # per thread, 4 threads
    label = f"mixed 512 B - {top // MiB} MiB" if top >= MiB else f"mixed 512 B - {top // KiB} KiB"
    return [
        dict(name="one size (4 KiB)", sizes=[4 * KiB], pairs=one, live=0, threads=1),
        dict(name=f"{label}, 64 live", sizes=mixed, pairs=one, live=64, threads=1),
        dict(name="one size (4 KiB), 4 threads", sizes=[4 * KiB], pairs=few // 4, live=0, threads=4),
        dict(name=f"{label}, 4 threads, 16 live each", sizes=mixed, pairs=few // 4, live=16, threads=4),
    ]


def core_pair_ns(case: Dict[str, Any], repeats: int = 3) -> float:
    """What the same case costs pyalloc's core alone, in C++ (pyalloc._C.bench_pairs over
    the virtual backend: no torch, no Python, no device): median ns per pair per thread."""
    import pyalloc
    from pyalloc import _C

    iterations = max(case["pairs"], 20_000)
    window = max(1, case["live"])  # bench_pairs keeps `window` live; 1 is an alloc then its free
    ns = []
    for _ in range(repeats):
        allocator = pyalloc.Allocator("virtual")
        _C.bench_pairs(allocator._core, case["sizes"], iterations // 10, case["threads"], window)  # warm
        ns.append(_C.bench_pairs(allocator._core, case["sizes"], iterations, case["threads"], window)
                  * 1e9 / iterations)
    return statistics.median(ns)


def alloc_speed(device: torch.device, smoke: bool, quick: bool, seed: int,
                core: bool = False) -> List[Dict[str, Any]]:
    """Workload 1: ns per torch.empty + release pair, and per torch.empty(0) pair, what
    torch costs per tensor around the allocator (PyTorch's own allocators and the
    bridge ask for no block of 0 bytes; through the C hooks torch's wrapper still
    calls pyalloc, which returns at once), each the median of several repeats taken
    in turn after a warm-up. ``core``: the C++ cost of the same pairs in pyalloc's
    core too (core_pair_ns)."""
    repeats = SPEED_REPEATS[speed_mode(smoke, quick)]
    out = []
    for case in alloc_speed_cases(smoke, quick, seed):
        args = (device, case["sizes"], case["pairs"], case["live"], case["threads"])
        empty = (device, [0], case["pairs"], case["live"], case["threads"])
        _timed_pairs(*args)  # warm-up: fills the cache, so every repeat sees the same state
        _timed_pairs(*empty)
        ns, base = [], []
        for _ in range(repeats):  # in turn, so that a slow moment touches both alike
            ns.append(_timed_pairs(*args))
            base.append(_timed_pairs(*empty))
        row = {
            "name": case["name"], "threads": case["threads"], "live": case["live"],
            "distinct_sizes": len(set(case["sizes"])), "largest_size": max(case["sizes"]),
            "pairs_per_thread": case["pairs"], "ns_per_pair": statistics.median(ns), "ns_repeats": ns,
            "baseline_ns": statistics.median(base), "baseline_repeats": base,
        }
        row["net_ns"] = row["ns_per_pair"] - row["baseline_ns"]
        text = (f"    {case['name']}: {row['ns_per_pair']:.0f} ns/pair, torch.empty(0) {row['baseline_ns']:.0f}, "
                f"beyond it {row['net_ns']:.0f}")
        if core:
            row["core_ns"] = core_pair_ns(case)
            text += f" (pyalloc's core in C++: {row['core_ns']:.0f})"
        out.append(row)
        print(text, flush=True)
    return out


# ---------------------------------------------------------------------------
# 2. Variable-length LLM training
# ---------------------------------------------------------------------------


def _gpt2(smoke: bool, small: bool = False, use_cache: bool = False):
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet_transformers()
    if smoke:
        cfg = dict(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=256)
    elif small:  # GPT-2 small, 124M parameters
        cfg = dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
    else:  # GPT-2 medium, 355M parameters, with room for 2048 tokens
        cfg = dict(n_layer=24, n_embd=1024, n_head=16, n_positions=2048, vocab_size=50257)
    config = GPT2Config(use_cache=use_cache, **cfg)
    return GPT2LMHeadModel(config), cfg


def _checkpoint_activations(model) -> None:
    """Recompute each block's activations in backward (non-reentrant torch.utils.checkpoint)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _llm_train(device: torch.device, size: int, smoke: bool, bf16_checkpointing: bool) -> Runner:
    model, cfg = _gpt2(smoke)
    if bf16_checkpointing:
        _checkpoint_activations(model)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lo, hi = (8, 32) if smoke else (128, 2048)
    vocab = cfg["vocab_size"]
    autocast = torch.bfloat16 if bf16_checkpointing else None

    def step(shape: Shape) -> None:
        ids = torch.randint(vocab, (shape["batch"], shape["length"]), device=device)
        _train_step(model, optimizer, autocast, device, input_ids=ids, labels=ids)

    return Runner(
        draw=lambda rng: {"batch": size, "length": rng.randint(lo, hi)},
        worst=lambda: {"batch": size, "length": hi},
        step=step, params=_params(model),
        config=dict(cfg, lengths=[lo, hi], optimizer="AdamW",
                    precision="bf16 autocast" if bf16_checkpointing else "fp32",
                    activation_checkpointing=bf16_checkpointing),
    )


def build_llm_train(device: torch.device, size: int, smoke: bool) -> Runner:
    return _llm_train(device, size, smoke, bf16_checkpointing=False)


def build_llm_train_bf16_ckpt(device: torch.device, size: int, smoke: bool) -> Runner:
    return _llm_train(device, size, smoke, bf16_checkpointing=True)


# ---------------------------------------------------------------------------
# 3. Dynamic-batch inference
# ---------------------------------------------------------------------------


def _half(device: torch.device) -> torch.dtype:
    """bf16 for inference on the GPU; fp32 on a CPU, where the smoke test only checks the path."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_bert_infer(device: torch.device, size: int, smoke: bool) -> Runner:
    from transformers import BertConfig, BertModel

    _quiet_transformers()
    if smoke:
        cfg = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=64, max_position_embeddings=64)
        lo, hi = 4, 32
    else:  # BERT-base, 110M parameters
        cfg = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                   intermediate_size=3072, max_position_embeddings=512)
        lo, hi = 16, 512
    model = BertModel(BertConfig(**cfg)).to(device=device, dtype=_half(device)).eval()

    def step(shape: Shape) -> None:
        ids = torch.randint(cfg["vocab_size"], (shape["batch"], shape["length"]), device=device)
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
            out.pooler_output.float().cpu()  # the answer leaves the GPU, as a server's would

    return Runner(
        draw=lambda rng: {"batch": rng.randint(1, size), "length": rng.randint(lo, hi)},
        worst=lambda: {"batch": size, "length": hi},
        step=step, params=_params(model),
        config=dict(cfg, lengths=[lo, hi], batch=[1, size], dtype=str(_half(device))),
    )


# ---------------------------------------------------------------------------
# 4. Generation with a growing KV cache
# ---------------------------------------------------------------------------


def build_generate(device: torch.device, size: int, smoke: bool) -> Runner:
    model, cfg = _gpt2(smoke, small=True, use_cache=True)
    model.to(device=device, dtype=_half(device)).eval()
    prompt = (4, 16) if smoke else (16, 512)
    # At most 128 new tokens: generate() took 44-72 ms a token on the H200 (2026-11-28),
    # and 256 made a batch-search probe 55 s long; the cache still grows a token at a time.
    new = (2, 8) if smoke else (16, 128)
    eos = model.config.eos_token_id

    def step(shape: Shape) -> None:
        ids = torch.randint(cfg["vocab_size"], (shape["batch"], shape["prompt"]), device=device)
        n = shape["new"]
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=eos)
            out.cpu()

    return Runner(
        draw=lambda rng: {"batch": rng.randint(1, size), "prompt": rng.randint(*prompt), "new": rng.randint(*new)},
        worst=lambda: {"batch": size, "prompt": prompt[1], "new": new[1]},
        step=step, params=_params(model),
        config=dict(cfg, prompt=list(prompt), new_tokens=list(new), batch=[1, size], greedy=True,
                    dtype=str(_half(device))),
    )


# ---------------------------------------------------------------------------
# 5. Mixed-resolution vision training
# ---------------------------------------------------------------------------


def build_vision_train(device: torch.device, size: int, smoke: bool) -> Runner:
    from transformers import ViTConfig, ViTForImageClassification

    _quiet_transformers()
    if smoke:
        cfg = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=64, num_labels=10)
        sides = list(range(16, 49, 8))
    else:  # ViT-B/16, 86M parameters
        cfg = dict(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                   intermediate_size=3072, num_labels=1000)
        sides = list(range(128, 385, 32))
    model = ViTForImageClassification(ViTConfig(**cfg)).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(shape: Shape) -> None:
        b, side = shape["batch"], shape["side"]
        x = torch.randn(b, 3, side, side, device=device)
        y = torch.randint(cfg["num_labels"], (b,), device=device)
        _train_step(model, optimizer, None, device, pixel_values=x, labels=y, interpolate_pos_encoding=True)

    return Runner(
        draw=lambda rng: {"batch": size, "side": rng.choice(sides)},
        worst=lambda: {"batch": size, "side": sides[-1]},
        step=step, params=_params(model),
        config=dict(cfg, sides=[sides[0], sides[-1]], optimizer="AdamW", precision="fp32 (TF32 matmul)"),
    )


# ---------------------------------------------------------------------------
# 6. Fixed-shape controls: nothing varies, so the native cache is never wrong
# ---------------------------------------------------------------------------


def build_control_resnet50(device: torch.device, size: int, smoke: bool) -> Runner:
    from transformers import ResNetConfig, ResNetForImageClassification

    _quiet_transformers()
    if smoke:
        cfg = dict(embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)
        side = 32
    else:  # ResNet-50: bottleneck blocks 3-4-6-3, 25.6M parameters
        cfg = dict(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 4, 6, 3],
                   layer_type="bottleneck", num_labels=1000)
        side = 224
    model = ResNetForImageClassification(ResNetConfig(**cfg)).to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(shape: Shape) -> None:
        b = shape["batch"]
        x = torch.randn(b, 3, side, side, device=device)
        y = torch.randint(cfg["num_labels"], (b,), device=device)
        _train_step(model, optimizer, None, device, pixel_values=x, labels=y)

    fixed = {"batch": size, "side": side}
    return Runner(draw=lambda rng: dict(fixed), worst=lambda: dict(fixed), step=step, params=_params(model),
                  config=dict(cfg, side=side, optimizer="SGD momentum", precision="fp32 (TF32 matmul)"))


class _Encoder(torch.nn.Module):
    """A pre-norm transformer encoder in plain torch, regressing random targets."""

    def __init__(self, width: int, layers: int, heads: int):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True,
                                                 norm_first=True)
        self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor, target: torch.Tensor):
        loss = torch.nn.functional.mse_loss(self.head(self.body(x)), target)
        return types.SimpleNamespace(loss=loss)


def build_control_transformer(device: torch.device, size: int, smoke: bool) -> Runner:
    width, layers, heads, length = (32, 2, 2, 8) if smoke else (1024, 12, 16, 512)
    model = _Encoder(width, layers, heads).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(shape: Shape) -> None:
        x = torch.randn(shape["batch"], shape["length"], width, device=device)
        _train_step(model, optimizer, None, device, x=x, target=torch.randn_like(x))

    fixed = {"batch": size, "length": length}
    return Runner(draw=lambda rng: dict(fixed), worst=lambda: dict(fixed), step=step, params=_params(model),
                  config=dict(width=width, layers=layers, heads=heads, length=length, optimizer="AdamW",
                              precision="fp32 (TF32 matmul)"))


# ---------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------

HF = ("transformers",)

SPECS: Dict[str, Spec] = {s.name: s for s in [
    Spec("alloc_speed", "torch.empty + release, ns per pair", "micro", (),
         size=0, size_name="", search_start=0, search_hi=0, steps=0, quick_steps=0, warmup=0, trace=False,
         extra_allocators=("pyalloc_hooks",)),  # the bridge against the C hooks, per call
    Spec("llm_train", "GPT-2 medium training, fp32, length 128-2048 per step", "steps", HF,
         size=4, size_name="batch", search_start=4, search_hi=256,
         steps=60, quick_steps=20, warmup=3, trace=True, trace_steps=6, build=build_llm_train),
    Spec("llm_train_bf16_ckpt", "GPT-2 medium training, bf16 autocast + activation checkpointing, "
         "length 128-2048 per step", "steps", HF,
         size=8, size_name="batch", search_start=16, search_hi=1024,
         steps=60, quick_steps=20, warmup=3, trace=True, trace_steps=6, build=build_llm_train_bf16_ckpt),
    Spec("bert_infer", "BERT-base inference, batch 1-N and length 16-512 per request", "steps", HF,
         size=64, size_name="max batch", search_start=1024, search_hi=16384,
         steps=200, quick_steps=60, warmup=5, trace=True, trace_steps=40, build=build_bert_infer),
    Spec("generate", "GPT-2 small generate(), batch 1-N, prompt 16-512, 16-128 new tokens", "steps", HF,
         # search_start: at 128, with calls of up to 256 new tokens, pyalloc's peak reserved
         # was 5.63 GiB of a 16 GiB budget (H200, 2026-11-28): 256 saves the search a probe.
         size=8, size_name="max batch", search_start=256, search_hi=4096,
         steps=30, quick_steps=10, warmup=2, trace=True, trace_steps=2, probe_steps=3, build=build_generate),
    Spec("vision_train", "ViT-B/16 training, image side 128-384 per step", "steps", HF,
         size=32, size_name="batch", search_start=64, search_hi=2048,
         steps=60, quick_steps=20, warmup=3, trace=True, trace_steps=10, build=build_vision_train),
    Spec("control_resnet50", "ResNet-50 training, fixed 224x224 (control)", "steps", HF,
         size=64, size_name="batch", search_start=256, search_hi=4096,
         steps=50, quick_steps=20, warmup=3, trace=False, build=build_control_resnet50),
    Spec("control_transformer", "transformer encoder training, fixed 512 tokens (control, plain torch)", "steps", (),
         size=16, size_name="batch", search_start=32, search_hi=2048,
         steps=50, quick_steps=20, warmup=3, trace=False, build=build_control_transformer),
]}

#: Names that --only accepts besides the workloads' own.
GROUPS: Dict[str, List[str]] = {
    "micro": ["alloc_speed"],
    "llm": ["llm_train", "llm_train_bf16_ckpt"],
    "serve": ["bert_infer", "generate"],
    "vision": ["vision_train"],
    "control": ["control_resnet50", "control_transformer"],
    "fragmenting": ["llm_train", "llm_train_bf16_ckpt", "bert_infer", "generate", "vision_train"],
    "all": list(SPECS),
}


def select(names: Optional[List[str]]) -> List[str]:
    """Workload names, in registry order, for --only's words (names or groups; all when empty)."""
    if not names:
        return list(SPECS)
    chosen = set()
    for word in names:
        if word in SPECS:
            chosen.add(word)
        elif word in GROUPS:
            chosen.update(GROUPS[word])
        else:
            raise ValueError(f"unknown workload '{word}'; workloads: {', '.join(SPECS)}; "
                             f"groups: {', '.join(GROUPS)}")
    return [name for name in SPECS if name in chosen]
