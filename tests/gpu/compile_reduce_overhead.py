"""torch.compile(mode="reduce-overhead") through the bridge (only there).

Inductor's CUDA-graph trees record each graph into a private pool and ask the
allocator about it: checkPoolLiveAllocations, getCheckpointState and
setCheckpointPoolState, snapshots of the pool. A small model runs several steps
of inference (two input shapes, so two graphs share the tree's pool) and of
training (forward and backward graphs), each step compared with eager mode on
the same weights; with slow_path_cudagraph_asserts the trees also check after
every step that the pool's live blocks are exactly the tensors they track.
Takes about a minute (Inductor compiles four graphs).
"""
import copy

import torch
import torch._inductor.config as inductor_config

import pyalloc
from gpu_common import bridge_only

STEPS = 6


def close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")


def main():
    bridge_only('torch.compile(mode="reduce-overhead") (CUDA-graph trees)')
    inductor_config.triton.slow_path_cudagraph_asserts = True
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.LayerNorm(256),
        torch.nn.Linear(256, 64),
    ).cuda()
    g = torch.Generator(device="cuda").manual_seed(1)

    # Inference, two shapes alternating.
    compiled = torch.compile(copy.deepcopy(model).eval(), mode="reduce-overhead", dynamic=False)
    with torch.no_grad():
        for step in range(STEPS):
            x = torch.randn(32 if step % 2 == 0 else 48, 64, device="cuda", generator=g)
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(x)
            close(out, model.eval()(x), f"inference step {step}")
    assert pyalloc._C.cuda_graph_pools(0), "no CUDA graph was recorded into a private pool"

    # Training: the compiled forward and backward against eager on the same weights.
    model.train()
    trained = copy.deepcopy(model)
    compiled_train = torch.compile(trained, mode="reduce-overhead", dynamic=False)
    for step in range(STEPS):
        x = torch.randn(32, 64, device="cuda", generator=g)
        torch.compiler.cudagraph_mark_step_begin()
        loss = compiled_train(x).square().mean()
        loss.backward()
        expected = model(x).square().mean()
        expected.backward()
        close(loss, expected, f"training step {step}, loss")
        for (name, p), q in zip(trained.named_parameters(), model.parameters()):
            close(p.grad, q.grad, f"training step {step}, gradient of {name}")
        trained.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)

    torch.cuda.synchronize()
    pools = pyalloc._C.cuda_graph_pools(0)
    assert pools and all(p["reserved_bytes"] > 0 for p in pools), pools
    pyalloc._C.cuda_check_invariants(0)
    print("OK")


if __name__ == "__main__":
    main()
