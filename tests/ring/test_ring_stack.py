"""RingDilatedAttention inside PyTorch's distributed stack: DeviceMesh groups and torch.compile.

On gloo processes (``ring_cluster.Cluster``), against the float64 reference on the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from reference import reference_attention
from ring_cluster import Cluster, inputs

from dilated_attention.ring import RingDilatedAttention, gather_sequence, shard_sequence

SEGS, RATES = [4, 16], [1, 2]


@pytest.fixture(scope="module")
def cluster4():
    cluster = Cluster(4, timeout_s=30.0)
    yield cluster
    cluster.close()


def _error_on(group_args: dict, rank_in_cp: int, P: int, seed: int) -> float:
    """This rank's output error against the reference, with the sequence split over ``P`` ranks."""
    q, k, v, _, _ = inputs(2, 8 * P, 4, 2, 8, seed=seed)
    n = 8
    sl = slice(rank_in_cp * n, (rank_in_cp + 1) * n)
    out = RingDilatedAttention(SEGS, RATES, **group_args)(q[:, sl], k[:, sl], v[:, sl], is_causal=True)
    ref, _ = reference_attention(q, k, v, SEGS, RATES, True)
    return (out - ref[:, sl]).abs().max().item()


def meshes(rank: int, P: int) -> dict[str, float | str]:
    """A 1-D mesh over all ranks, and a ("dp", "cp") mesh of 2 x 2 given three ways; plus the
    errors that a wrong mesh argument raises."""
    from torch.distributed.device_mesh import init_device_mesh

    got: dict[str, float | str] = {}
    mesh1 = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
    got["1-D mesh"] = _error_on({"process_group": mesh1}, rank, P, seed=1)
    mesh2 = init_device_mesh("cpu", (2, P // 2), mesh_dim_names=("dp", "cp"))
    cp = mesh2.get_local_rank("cp")
    seed = 2 + mesh2.get_local_rank("dp")  # each data-parallel replica has its own sequence
    got["mesh, mesh_dim"] = _error_on({"process_group": mesh2, "mesh_dim": "cp"}, cp, P // 2, seed)
    got["mesh['cp']"] = _error_on({"process_group": mesh2["cp"]}, cp, P // 2, seed)
    got["mesh_dim int"] = _error_on({"process_group": mesh2, "mesh_dim": 1}, cp, P // 2, seed)
    x = torch.arange(2.0 * P).reshape(1, 2 * P, 1, 1)
    part = shard_sequence(x, mesh2, mesh_dim="cp")
    got["shard/gather"] = float(torch.equal(gather_sequence(part, mesh2, mesh_dim="cp"), x))
    for name, kwargs, error in [
        ("2-D without mesh_dim", {"process_group": mesh2}, ValueError),
        ("unknown dim", {"process_group": mesh2, "mesh_dim": "tp"}, ValueError),
        ("mesh_dim without mesh", {"process_group": dist.group.WORLD, "mesh_dim": "cp"}, TypeError),
    ]:
        try:
            RingDilatedAttention(SEGS, RATES, **kwargs)
            got[name] = "no error"
        except error as err:
            got[name] = str(err)
    return got


def test_device_mesh_wherever_a_process_group_goes(cluster4):
    for rank, got in enumerate(cluster4.run(meshes)):
        for name in ("1-D mesh", "mesh, mesh_dim", "mesh['cp']", "mesh_dim int"):
            assert got[name] < 1e-12, f"rank {rank}, {name}: error {got[name]}"
        assert got["shard/gather"] == 1.0
        assert "2-D DeviceMesh" in got["2-D without mesh_dim"] and "mesh_dim=" in got["2-D without mesh_dim"]
        assert "mesh_dim='tp'" in got["unknown dim"] and "'cp'" in got["unknown dim"]
        assert "not a DeviceMesh" in got["mesh_dim without mesh"]


def compiled(rank: int, P: int, comm: str) -> dict[str, object]:
    """torch.compile of the module (default mode): the output and gradients equal eager mode, and
    no graph breaks at host timers."""
    import torch._dynamo as dynamo

    torch._dynamo.reset()
    q, k, v, dout, _ = inputs(1, 4 * P, 2, 2, 8, seed=3)
    n = 4
    sl = slice(rank * n, (rank + 1) * n)
    module = RingDilatedAttention([4 * P], [2], comm=comm)
    eager_in = [t[:, sl].clone().requires_grad_() for t in (q, k, v)]
    eager = module(*eager_in)
    eager_grads = torch.autograd.grad((eager * dout[:, sl]).sum(), eager_in)
    explained = dynamo.explain(module)(*(t[:, sl] for t in (q, k, v)))
    comp_in = [t[:, sl].clone().requires_grad_() for t in (q, k, v)]
    out = torch.compile(module, backend="aot_eager")(*comp_in)
    grads = torch.autograd.grad((out * dout[:, sl]).sum(), comp_in)
    diffs = [(a - b).abs().max().item() for a, b in zip((out, *grads), (eager, *eager_grads), strict=True)]
    reasons = [str(b.reason) for b in explained.break_reasons]
    return {"diff": max(diffs), "breaks": explained.graph_break_count, "reasons": reasons}


def test_compile_matches_eager_without_host_timers(cluster4):
    """comm="all_gather" (the one to compile; comm="ring" breaks the graph at every point-to-point
    step, see docs/sequence-parallel.md)."""
    for got in cluster4.run(compiled, "all_gather"):
        assert got["diff"] < 1e-12, got
        assert not any("perf_counter" in r for r in got["reasons"]), got["reasons"]
        # inputs without gradients: the one break is the consistency check's host read (docs)
        assert got["breaks"] <= 1, got


def graphs_over_calls(rank: int, P: int) -> list[int]:
    """The graphs Dynamo has compiled after 3 and after 7 calls of the compiled module (forward and
    backward): the calls after the first few compile nothing (the communication counters are not
    guarded values of the graph)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    module = torch.compile(RingDilatedAttention([4 * P], [2], comm="all_gather"), backend="aot_eager")
    seen = []
    for call in range(7):
        q, k, v = (t.requires_grad_() for t in inputs(1, 4, 2, 2, 8, seed=10 + call)[:3])
        module(q, k, v).sum().backward()
        if call in (2, 6):
            seen.append(int(counters["stats"]["unique_graphs"]))
    return seen


def test_compiled_module_is_not_recompiled_at_every_call(cluster4):
    for rank, (early, late) in enumerate(cluster4.run(graphs_over_calls)):
        assert late == early, f"rank {rank}: {early} graphs after 3 calls, {late} after 7"


def _tiny_model(E: int, H: int, group_args: dict) -> torch.nn.Module:
    """Embedding-free: a projection in, the multi-head ring attention, a projection out."""
    from dilated_attention.ring import RingMultiheadDilatedAttention

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(E, E, dtype=torch.float64)
            self.attn = RingMultiheadDilatedAttention(E, H, SEGS, RATES, dtype=torch.float64, **group_args)
            self.out = torch.nn.Linear(E, E, dtype=torch.float64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.attn(self.inp(x), is_causal=True)[0])

    torch.manual_seed(0)  # the same weights on every rank and in the reference
    return Tiny()


def data_parallel(rank: int, P: int, wrapper: str) -> float:
    """A ("dp", "cp") = (2, 2) mesh: each replica trains on its own sequence, split over "cp";
    FSDP2 on the whole mesh (replicated over dp, sharded over cp) or DDP over all ranks. Each
    rank's loss is the mean over its own tokens; the gradients must equal one process's gradients
    of the mean over every token of both sequences. Returns the largest difference."""
    from torch.distributed.device_mesh import init_device_mesh

    E, H, B, N = 16, 4, 2, 32
    mesh = init_device_mesh("cpu", (2, P // 2), mesh_dim_names=("dp", "cp"))
    dp, cp, n = mesh.get_local_rank("dp"), mesh.get_local_rank("cp"), N // (P // 2)
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(2, B, N, E, generator=g, dtype=torch.float64)  # one sequence batch per replica
    dys = torch.randn(2, B, N, E, generator=g, dtype=torch.float64)

    alone = [dist.new_group([r]) for r in range(P)][rank]  # a group of one: the one-process op
    reference = _tiny_model(E, H, {"process_group": alone})
    total = sum((reference(xs[i]) * dys[i]).sum() for i in range(2)) / (2 * B * N)
    total.backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}

    model = _tiny_model(E, H, {"process_group": mesh, "mesh_dim": "cp"})
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    sl = slice(cp * n, (cp + 1) * n)
    loss = (model(xs[dp][:, sl]) * dys[dp][:, sl]).sum() / (B * n)
    loss.backward()
    worst = 0.0
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        worst = max(worst, (grad - expected[name.removeprefix("module.")]).abs().max().item())
    return worst


@pytest.mark.parametrize("wrapper", ["fsdp2", "ddp"])
def test_fsdp2_and_ddp_over_a_dp_cp_mesh_equal_one_process(cluster4, wrapper):
    for rank, worst in enumerate(cluster4.run(data_parallel, wrapper)):
        assert worst < 1e-12, f"rank {rank}: gradients differ from one process by {worst:.3e}"
