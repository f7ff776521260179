"""The CPU backend is inert on a CUDA machine and refuses other megatron-core versions. Each check runs
in a process of its own that has not enabled the backend (a fork of the tests' fork server, or a fresh
interpreter), since the patches are process-wide."""

from __future__ import annotations

import subprocess

from support import REPO
from support.distributed import rank_launch_cmd, trainer_env


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        rank_launch_cmd(1, ["-c", code], []), cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=300
    )


def test_does_nothing_when_cuda_is_available():
    p = _run(
        "import torch\n"
        "from k2.parallel import cpu_backend\n"
        "cpu_backend.cuda_available = lambda: True\n"
        "orig = (torch.cuda.current_device, torch.Tensor.type, torch.cuda.Stream)\n"
        "assert cpu_backend.enable() is False\n"
        "assert not cpu_backend.is_enabled()\n"
        "assert (torch.cuda.current_device, torch.Tensor.type, torch.cuda.Stream) == orig\n"
        "print('inert')\n"
    )
    assert p.returncode == 0 and "inert" in p.stdout, p.stderr[-2000:]


def test_refuses_another_megatron_version():
    p = _run(
        "import importlib.metadata as md\n"
        "real = md.version\n"
        "md.version = lambda name: '0.20.0' if name == 'megatron-core' else real(name)\n"
        "from k2.parallel import cpu_backend\n"
        "try:\n"
        "    cpu_backend.enable()\n"
        "except RuntimeError as e:\n"
        "    print('refused:', e)\n"
    )
    assert "refused:" in p.stdout and "0.19.2" in p.stdout and "0.20.0" in p.stdout, p.stdout + p.stderr[-2000:]


def test_patches_make_megatron_cuda_calls_host_calls():
    p = _run(
        "import torch\n"
        "from k2.parallel import cpu_backend\n"
        "assert cpu_backend.enable() is True\n"
        "t = torch.empty(3, device=torch.cuda.current_device())\n"
        "assert t.device.type == 'cpu'\n"
        "assert torch.zeros(2, device='cuda').device.type == 'cpu'\n"
        "assert torch.ones(2).float().type() == 'torch.cuda.FloatTensor'\n"
        "assert torch.ones(2).type(torch.float64).dtype == torch.float64\n"
        "s = torch.cuda.get_rng_state(); a = torch.rand(1); torch.cuda.set_rng_state(s); b = torch.rand(1)\n"
        "assert torch.equal(a, b)\n"
        "print('ok')\n"
    )
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-2000:]


def test_every_device_argument_is_the_hosts_and_other_operators_stay_native():
    """The CUDA ``device`` of each kind of torch function megatron-core calls (factories, ``*_like``,
    ``Tensor.new_*``, ``Tensor.to`` by keyword and by position) lands on the host, a ``torch.device``
    context still gives the factories its device; nothing intercepts the other operators (no
    torch-function mode: a Python call per operator would double the cost of a small model's operators)."""
    p = _run(
        "import torch\n"
        "from k2.parallel import cpu_backend\n"
        "assert cpu_backend.enable() is True\n"
        "x = torch.ones(4)\n"
        "made = [torch.empty(2, device='cuda'), torch.zeros(2, device=0), torch.ones(2, device='cuda:0'),\n"
        "        torch.full((2,), 1.0, device=torch.device('cuda', 0)), torch.tensor([1.0], device='cuda'),\n"
        "        torch.arange(3, device='cuda'), torch.randn(2, device='cuda'),\n"
        "        torch.randint(5, (2,), device='cuda'), torch.randperm(4, device='cuda'),\n"
        "        torch.empty_strided((2,), (1,), device='cuda'),\n"
        "        torch.eye(2, device='cuda'), torch.linspace(0, 1, 3, device='cuda'),\n"
        "        torch.zeros_like(x, device='cuda'), torch.empty_like(x, device=0), x.new_zeros(2, device='cuda'),\n"
        "        x.new_empty(2, device='cuda'), x.new_tensor([1.0], device='cuda'), x.to('cuda'), x.to(0),\n"
        "        x.to(torch.device('cuda')), x.to(device='cuda', dtype=torch.float64), x.to('cuda', torch.int32),\n"
        "        torch.as_tensor([1.0], device='cuda'), x.cuda()]\n"
        "assert all(t.device.type == 'cpu' for t in made), [t.device for t in made]\n"
        "assert x.to(torch.float64).dtype == torch.float64 and x.to('cuda', torch.int32).dtype == torch.int32\n"
        "assert not torch._C._is_torch_function_mode_enabled()\n"
        "with torch.device('meta'):\n"  # (transformers builds its models so: the context's device stands)
        "    assert [torch.arange(3).device.type, torch.empty(2).device.type, x.new_zeros(2).device.type,\n"
        "            torch.zeros(2, device='cuda').device.type] == ['meta', 'meta', 'cpu', 'cpu']\n"
        "print('ok')\n"
    )
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-2000:]
