"""install()'s refusals on a machine with a GPU.

    install_errors.py after-cuda | twice
"""
import sys

import torch

import pyalloc


def main(mode):
    if mode == "after-cuda":
        x = torch.zeros(1, device="cuda")  # PyTorch's own allocator is now in use
        try:
            pyalloc.install()
            raise AssertionError("install() after CUDA use succeeded")
        except RuntimeError as e:
            message = str(e)
            for fix in ("call pyalloc.install() first", "python -m pyalloc run", "PYALLOC_CONF"):
                assert fix in message, message
        assert not pyalloc.is_installed()
        # torch's statistics still come from torch's own allocator.
        assert torch.cuda.memory_allocated() > 0
    elif mode == "twice":
        pyalloc.install(pool_size="32MiB")
        pyalloc.install(pool_size="32MiB")  # same settings: nothing happens
        try:
            pyalloc.install(pool_size="64MiB")
            raise AssertionError("a second install with other settings succeeded")
        except RuntimeError as e:
            assert "already installed" in str(e), e
        x = torch.ones(10, device="cuda")
        assert torch.cuda.memory_reserved() == 32 << 20
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
