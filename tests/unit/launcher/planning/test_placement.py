"""Where k2-plan's EP, DP and PP groups fall across NVLink domains (launcher/planning/placement.py), the
job's share of an NVL72 rack (``cluster.segment_nodes``), and the all-to-all of a group that straddles two
domains."""

from __future__ import annotations

import pytest

from k2.config import ConfigError, load_config
from k2.launcher.planning.analysis import cluster_profile
from k2.launcher.planning.comm import ep_alltoall
from k2.launcher.planning.hardware import load_profile
from k2.launcher.planning.placement import block_crosses, ep_group_pieces, pieces, pp_hop_crosses

T = 4096  # tokens of one microbatch


def test_pieces_of_groups_against_a_72_gpu_domain():
    """EP64 over 128 GPUs of 72-GPU racks (PP2): the first group fills rack 0's first 64 GPUs, the second
    holds 8 GPUs of rack 0 and 56 of rack 1; EP8 divides 72, so every group stays inside a rack."""
    assert pieces(64, 64, 72) == (8, 56) and pieces(0, 64, 72) == (64,) and pieces(70, 4, 72) == (2, 2)
    assert ep_group_pieces(128, 2, 64, 72) == ((56, 8), (64,))
    assert ep_group_pieces(144, 9, 8, 72) == ((8,),)
    assert ep_group_pieces(128, 2, 64, 64) == ((64,),)
    assert block_crosses(128, 2, 72) and not block_crosses(128, 2, 64) and not block_crosses(144, 2, 72)
    assert pp_hop_crosses(128, 4, 72) and not pp_hop_crosses(64, 4, 72) and not pp_hop_crosses(128, 1, 8)


def test_a_straddling_ep_group_is_priced_at_its_slowest_rank():
    """A rank of the 8-GPU piece sends 56 of every 64 copies over the network (NCCL's rates), 7 over
    NVLink; the aligned group sends nothing across, so the straddling all-to-all is several times slower.
    DeepEP: a token visits the other piece with probability 1 - (1 - 56/64)^8."""
    gb = load_profile("gb200_nvl72")
    aligned = ep_alltoall(T, 8, 7168, 64, gb, bytes_per_element=2, pieces=((64,),))
    split = ep_alltoall(T, 8, 7168, 64, gb, bytes_per_element=2, pieces=((64,), (56, 8)))
    copy = 7168 * 2
    assert aligned.inter_bytes == 0
    assert split.inter_bytes == pytest.approx(T * 8 * 56 / 64 * copy)
    assert split.intra_bytes == pytest.approx(T * 8 * 7 / 64 * copy)
    assert split.seconds > 5 * aligned.seconds
    deep = ep_alltoall(T, 8, 7168, 64, gb, bytes_per_element=2, deepep=True, pieces=((56, 8),))
    assert deep.inter_bytes == pytest.approx(T * (1 - (1 - 56 / 64) ** 8) * copy)
    # without pieces: aligned, min(ep, domain) ranks per domain (as before this module)
    assert ep_alltoall(T, 8, 7168, 64, gb, bytes_per_element=2).seconds == pytest.approx(aligned.seconds)


def _domain(*overrides) -> int:
    cfg = load_config(["model=kimi_k2", "plan.hardware=gb200_nvl72", "cluster.gpus_per_node=4", *overrides])
    return cluster_profile(cfg).domain_gpus


def test_the_jobs_share_of_an_nvl72_rack():
    """One rack or less: the whole rack; 32 trays: NVIDIA's recommended segment of 16 trays (64 GPUs);
    36 trays: 16 does not divide them, so whole racks of 18; a segment larger than the rack or not
    dividing the job is one error line naming cluster.segment_nodes; an 8-GPU host profile ignores it."""
    assert _domain("cluster.nodes=18") == 72
    assert _domain("cluster.nodes=32") == 64
    assert _domain("cluster.nodes=36") == 72
    assert _domain("cluster.nodes=32", "cluster.segment_nodes=8") == 32
    with pytest.raises(ConfigError, match=r"^cluster.segment_nodes=32: .*allowed: 1 to 18, or null$"):
        _domain("cluster.nodes=64", "cluster.segment_nodes=32")
    with pytest.raises(ConfigError, match=r"cluster.segment_nodes=16: allowed: null or a divisor of cluster.nodes"):
        load_config(["cluster.nodes=36", "cluster.segment_nodes=16"])
    b200 = load_config(["model=kimi_k2", "plan.hardware=b200", "cluster.nodes=32", "cluster.segment_nodes=4"])
    assert cluster_profile(b200).domain_gpus == 8


def test_smaller_segments_split_ep64_and_the_plan_pays_for_it():
    """K2 on 128 GB200 as PP2 EP64: with segments of 16 trays each EP group is one segment; with segments of
    8 trays (32 GPUs) every group spans two and half of each rank's copies cross the network."""
    from k2.launcher.planning.cluster import plan_cluster

    base = [
        "model=kimi_k2",
        "plan.hardware=gb200_nvl72",
        "cluster.nodes=32",
        "cluster.gpus_per_node=4",
        "parallel=single",
        "parallel.pp=2",
        "parallel.vpp=4",
        "parallel.ep=64",
        "parallel.layout='Etttttttt|tttttttt|tttttttt|tttttttt|tttttttt|tttttttt|tttttttt|tttttL'",
    ]
    inside = plan_cluster(load_config(base)).report
    racks = plan_cluster(load_config([*base, "cluster.segment_nodes=8"])).report
    assert inside["nvlink_domain_gpus"] == 64 and racks["nvlink_domain_gpus"] == 32
    assert racks["step_time_breakdown_s"]["ep_comm"] > 3 * inside["step_time_breakdown_s"]["ep_comm"]


def test_a_node_larger_than_the_profiles_host_is_refused():
    """A GB200 compute tray carries 4 GPUs: 8 per node is one error line; fewer than the host's is a job
    that uses part of each node."""
    refused = r"^cluster.gpus_per_node=8: a host of plan.hardware=gb200_nvl72 carries 4 GPUs"
    with pytest.raises(ConfigError, match=refused):
        _domain("cluster.nodes=16", "cluster.gpus_per_node=8")
    assert _domain("cluster.nodes=16", "cluster.gpus_per_node=2") == 72
