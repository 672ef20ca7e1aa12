"""The online packing core (phalanx.core.packing): fit rules, FGD's fragmentation measure, and each policy's choice on
small clusters whose right answer is worked out by hand."""

from __future__ import annotations

import pytest

from phalanx.core.packing import Fragmentation, Packer, PackNode, PackTask, TypicalMix, fits


def node(name="n", model="G2", cpu=96_000, memory=393_216, gpus=(1000,) * 8):
    return PackNode(name, model, cpu, memory, list(gpus))


def test_fit_rules():
    n = node(gpus=(1000, 400, 0))
    assert fits(n, PackTask(cpu=1000, memory=10, gpus=1, milli=400))  # a share fits the GPU with 400 left
    assert fits(n, PackTask(cpu=1000, gpus=1, milli=500))  # ... on the free GPU
    assert fits(n, PackTask(cpu=1000, gpus=1, milli=1000))
    assert not fits(n, PackTask(cpu=1000, gpus=2, milli=1000))  # one untouched GPU only
    assert not fits(n, PackTask(cpu=97_000))  # CPU
    assert not fits(n, PackTask(cpu=1, memory=400_000))  # memory
    assert not fits(n, PackTask(cpu=1, gpus=1, milli=1000, models=("T4",)))  # model
    assert fits(n, PackTask(cpu=1, gpus=1, milli=1000, models=("T4", "G2")))
    assert fits(n, PackTask(cpu=96_000, memory=393_216))  # a CPU-only task may take the whole node


def test_fragmentation_matches_the_fgd_definition_worked_by_hand():
    # Mix: a half-GPU task needing 4 cores (p=0.5), a whole GPU needing 8 cores (p=0.3), a CPU-only task (p=0.2).
    mix = TypicalMix([(PackTask(4000, 0, 1, 500), 0.5), (PackTask(8000, 0, 1, 1000), 0.3), (PackTask(2000), 0.2)])
    f = Fragmentation(mix)
    # Idle GPUs [1000, 300], plenty of CPU: the half task cannot use the 300 (0.5*300), the whole GPU task cannot use
    # the 300 (0.3*300), the CPU-only task can use no GPU (0.2*1300).
    assert f.of("G2", 96_000, [1000, 300]) == pytest.approx(0.5 * 300 + 0.3 * 300 + 0.2 * 1300)
    # With 6 cores left the whole-GPU task cannot run at all: all 1300 count for it.
    assert f.of("G2", 6000, [1000, 300]) == pytest.approx(0.5 * 300 + 0.3 * 1300 + 0.2 * 1300)
    # Nothing idle, nothing fragmented; and GPU order does not matter.
    assert f.of("G2", 6000, [0, 0]) == 0
    assert f.of("G2", 96_000, [300, 1000]) == f.of("G2", 96_000, [1000, 300])


def test_typical_mix_keeps_the_popular_shapes_and_ignores_memory():
    tasks = (
        [PackTask(4000, m, 1, 500) for m in (1, 2, 3, 4, 5, 6)]
        + [PackTask(8000, 0, 1, 1000)] * 3
        + [PackTask(1000, 0, 2, 1000)]
    )
    mix = TypicalMix.from_tasks(tasks, threshold=0.9)
    shapes = dict(mix.tasks)
    # Six half-GPU tasks differing only in memory are one shape (60%); with the whole-GPU shape that is 90%: the
    # 2-GPU task (10%) is left out and the weights renormalised.
    assert shapes == {PackTask(4000, 0, 1, 500): pytest.approx(6 / 9), PackTask(8000, 0, 1, 1000): pytest.approx(3 / 9)}
    assert mix.cpu_per_milli == pytest.approx((6 * 4000 + 3 * 8000 + 1000) / (6 * 500 + 3 * 1000 + 2000))


def test_bestfit_takes_the_fullest_node_and_the_fullest_gpu_a_share_fits():
    nodes = [node("empty"), node("busy", gpus=(1000, 1000, 700, 300, 0, 0, 0, 0))]
    p = Packer(nodes, "bestfit")
    assert p.place(PackTask(1000, 0, 1, 300)) == (1, (3,))  # the 300 left on busy's GPU 3, not 700 or a new GPU
    assert p.place(PackTask(1000, 0, 1, 1000)) == (1, (0,))
    assert nodes[1].gpus == [0, 1000, 700, 0, 0, 0, 0, 0] and p.allocated_milli == 1300


def test_fgd_puts_a_share_where_it_strands_least():
    # Typical tasks: 600-milli shares. A 600 share on the GPU with 600 left uses it up; on a free GPU it would leave
    # 400 that no typical task can use.
    mix = TypicalMix([(PackTask(1000, 0, 1, 600), 1.0)])
    nodes = [node("a", gpus=(700, 1000)), node("b", gpus=(600, 1000))]
    p = Packer(nodes, "fgd", mix)
    assert p.place(PackTask(1000, 0, 1, 600)) == (1, (0,))
    # Next: a's 700 (leaving 100) beats b's free GPU (leaving 400) and a's free GPU (leaving 400 beside the 700).
    assert p.place(PackTask(1000, 0, 1, 600)) == (0, (0,))


def test_equal_scores_go_to_the_first_node_unless_random_ties():
    mix = TypicalMix([(PackTask(1000, 0, 1, 1000), 1.0)])
    picks = {
        Packer([node(str(i)) for i in range(6)], "fgd", mix).place(PackTask(1000, 0, 1, 1000))[0] for _ in range(5)
    }
    assert picks == {0}
    import random

    rng = random.Random(3)
    spread = {
        Packer([node(str(i)) for i in range(6)], "fgd", mix, rng=rng, random_ties=True).place(
            PackTask(1000, 0, 1, 1000)
        )[0]
        for _ in range(40)
    }
    assert len(spread) > 1


def test_phalanx_keeps_cpu_where_gpus_need_it():
    # The workload needs 4 milli-CPU per milli-GPU. Node "lean" can feed 4 of its 8 GPUs, "rich" all 8 and more.
    # A 12-core CPU-only task changes no typical task's fit on either node, so FGD sees a tie and takes the first
    # node ("lean", leaving it able to feed 1 GPU); Phalanx counts the GPUs left without CPU and takes "rich".
    mix = TypicalMix([(PackTask(4000, 0, 1, 1000), 1.0)], cpu_per_milli=4.0)
    task = PackTask(12_000)
    fgd = Packer([node("lean", cpu=16_000), node("rich", cpu=40_000)], "fgd", mix)
    phalanx = Packer([node("lean", cpu=16_000), node("rich", cpu=40_000)], "phalanx", mix)
    assert fgd.place(task)[0] == 0
    assert phalanx.place(task)[0] == 1


def test_refusal_changes_nothing_and_the_cache_sees_changes():
    mix = TypicalMix([(PackTask(1000, 0, 1, 1000), 1.0)])
    nodes = [node("a", gpus=(1000,)), node("b", gpus=(1000,))]
    p = Packer(nodes, "phalanx", mix)
    t = PackTask(1000, 0, 1, 1000)
    assert p.place(t)[0] == 0 and p.place(t)[0] == 1  # the second sees a's change through the score cache
    before = [(n.cpu, n.memory, list(n.gpus)) for n in nodes]
    assert p.place(t) is None
    assert [(n.cpu, n.memory, list(n.gpus)) for n in nodes] == before and p.allocation_ratio == 1.0


def test_unknown_policy_and_missing_mix_are_errors():
    with pytest.raises(ValueError, match="unknown packing policy"):
        Packer([node()], "worstfit")
    with pytest.raises(ValueError, match="needs the workload"):
        Packer([node()], "fgd")


def test_the_scheduler_scores_shares_with_this_fragmentation_measure():
    # The live scheduler's share placement (core.shares, through place_gang) and `phalanx sim fgd` use one measure.
    from phalanx.core.capacity import ClusterCapacity
    from phalanx.core.model import GangRequest, NodeCapacity
    from phalanx.core.placement import place_gang
    from phalanx.core.shares import DEFAULT_MIX, place_partial, share_fragmentation

    h100 = ("NVIDIA H100 80GB HBM3", 81559)
    split = NodeCapacity("split", 8, set(range(1, 8)), True, ("leaf0",), None, *h100, milli={0: 600})
    cap = ClusterCapacity([NodeCapacity("empty", 8, set(range(8)), True, ("leaf0",), None, *h100), split])
    placed = place_gang(cap, GangRequest("s", 1, 1, gpu_milli=400))
    assert (placed.replicas[0].node, placed.replicas[0].gpus) == ("split", (0,))  # fills the 600-used GPU
    f = share_fragmentation(DEFAULT_MIX)
    assert isinstance(f, Fragmentation)
    model = h100[0]
    expected = (f.of(model, 1 << 62, [1000] * 7 + [0]) - f.of(model, 1 << 62, [1000] * 7 + [400])) / 1000
    assert expected < 0  # filling the GPU up removes its 400 that whole-GPU tasks could not use
    decision = place_partial(cap, GangRequest("s2", 1, 1, gpu_milli=400))
    assert decision.score == pytest.approx(expected, abs=1e-6)  # the reason's delta is this measure's change


def test_the_fragmentation_memo_stays_bounded(monkeypatch):
    import phalanx.core.packing as packing

    monkeypatch.setattr(packing, "_MEMO_LIMIT", 4)
    f = Fragmentation(TypicalMix([(PackTask(1000, 0, 1, 500), 1.0)]))
    values = [f.of("G2", 96_000, [1000, used]) for used in range(0, 1000, 100)]
    assert len(f._memo) <= 4
    assert values == [Fragmentation(f.mix).of("G2", 96_000, [1000, used]) for used in range(0, 1000, 100)]
