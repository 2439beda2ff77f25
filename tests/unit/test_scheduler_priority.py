"""The priority policy and token fairness, with hand-built requests and no model (the harness of
test_scheduler_unit: exact block accounting after every step)."""
from __future__ import annotations

import pytest

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.scheduler.request import Tenant
from pagedserve.scheduler.request_queue import TokenFairness
from pagedserve.tests.unit.test_scheduler_unit import Harness, prompt


def _long(n: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _first_step_of(h: Harness, names: list[str]) -> dict[str, int]:
    """Run to the end; the step at which each request first got tokens."""
    first: dict[str, int] = {}
    seq_of = {h.sched.requests[n].seqs[0].seq_id: n for n in names}
    for i, s in enumerate(h.run_until_done()):
        for seq_id in s.out.num_scheduled_tokens:
            if seq_id in seq_of:
                first.setdefault(seq_of[seq_id], i)
    return first


def test_waiting_requests_start_by_priority_then_arrival() -> None:
    h = Harness(max_num_seqs=1, scheduling_policy="priority")
    for name, prio in (("a", 3), ("b", 0), ("c", 3), ("d", -1), ("e", 0)):
        h.add(name, prompt(3, start=10 * len(name) + prio + 20), _long(2), priority=prio)
    first = _first_step_of(h, ["a", "b", "c", "d", "e"])
    assert sorted(first, key=first.get) == ["d", "b", "e", "a", "c"]
    h.assert_all_free()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_equal_priorities_keep_arrival_order(policy: str) -> None:
    h = Harness(max_num_seqs=1, scheduling_policy=policy)
    for name in "abc":
        h.add(name, prompt(3), _long(2))
    first = _first_step_of(h, list("abc"))
    assert sorted(first, key=first.get) == list("abc")


def _step_until_a_preemption(h: Harness, max_steps: int = 20):
    for _ in range(max_steps):
        s = h.step()
        if sum(h.sched.stats.num_preemptions.values()):
            return s
    pytest.fail("no preemption")


def test_short_of_blocks_the_lowest_priority_running_request_is_preempted_not_the_latest() -> None:
    h = Harness(num_blocks=4, block_size=4, scheduling_policy="priority")
    low = h.add("low", prompt(4), _long(6), priority=5)  # arrives first
    high = h.add("high", prompt(4, start=30), _long(6), priority=0)
    s = _step_until_a_preemption(h)  # at position 8 each needs a third block, and none is free
    assert low.num_preemptions == 1 and high.num_preemptions == 0
    assert high.seqs[0].seq_id in s.out.num_scheduled_tokens and low in h.sched.waiting
    h.run_until_done()
    assert low.seqs[0].num_output_tokens == 6 and high.seqs[0].num_output_tokens == 6
    h.assert_all_free()


def test_fcfs_preempts_the_latest_arrival_whatever_its_priority() -> None:
    h = Harness(num_blocks=4, block_size=4, scheduling_policy="fcfs")
    early = h.add("early", prompt(4), _long(6), priority=5)
    late = h.add("late", prompt(4, start=30), _long(6), priority=0)
    _step_until_a_preemption(h)
    assert late.num_preemptions == 1 and early.num_preemptions == 0


def test_an_urgent_request_preempts_a_worse_priority_to_get_a_slot_at_once() -> None:
    h = Harness(max_num_seqs=2, scheduling_policy="priority")
    a = h.add("a", prompt(3), _long(20), priority=1)
    b = h.add("b", prompt(3, start=30), _long(20), priority=2)
    h.step()
    h.step()
    urgent = h.add("urgent", prompt(3, start=60), _long(2), priority=0)
    s = h.step()
    assert urgent.seqs[0].seq_id in s.out.num_scheduled_tokens  # the first step after its arrival
    assert b.num_preemptions == 1 and a.num_preemptions == 0  # the worst priority went, not the latest arrival
    h.run_until_done()
    h.assert_all_free()


def test_an_urgent_request_preempts_for_blocks_too() -> None:
    h = Harness(num_blocks=6, block_size=4, scheduling_policy="priority")
    bulk = [h.add(f"bulk{i}", prompt(8, start=20 * i + 10), _long(12), priority=3) for i in range(3)]
    h.step()  # 6 of 6 blocks
    urgent = h.add("urgent", prompt(8, start=90), _long(2), priority=0)
    s = h.step()
    assert urgent.seqs[0].seq_id in s.out.num_scheduled_tokens
    # The latest first, and as many as its prompt and the others' next tokens need (each of these needs a block for
    # position 8): bulk0 keeps running.
    assert [r.num_preemptions for r in bulk] == [0, 1, 1] and bulk[0] in h.sched.running
    h.run_until_done()
    h.assert_all_free()


def test_equal_or_worse_priorities_never_preempt_a_running_request() -> None:
    h = Harness(max_num_seqs=1, scheduling_policy="priority")
    a = h.add("a", prompt(3), _long(4), priority=1)
    h.step()
    h.add("same", prompt(3, start=30), _long(2), priority=1)
    h.add("worse", prompt(3, start=60), _long(2), priority=2)
    for _ in range(3):
        h.step()
    assert a.num_preemptions == 0
    h.run_until_done()
    h.assert_all_free()


def test_a_swapped_request_of_worse_priority_does_not_block_an_urgent_one() -> None:
    h = Harness(num_blocks=6, block_size=4, num_cpu_blocks=16, scheduling_policy="priority")
    h.add("other", prompt(4, start=40), _long(4), priority=4)
    group = h.add("group", prompt(4), SamplingParams(n=2, max_tokens=4, ignore_eos=True), priority=4)
    h.step()
    h.step()  # 5 of 6 blocks: other's 2, group's shared prompt block and one each
    urgent = h.add("urgent", prompt(8, start=80), _long(2), priority=0)
    s = h.step()
    assert list(h.sched.swapped) == [group]  # the worst key (the latest of priority 4), swapped as it forked
    assert urgent.seqs[0].seq_id in s.out.num_scheduled_tokens
    h.run_until_done()
    h.assert_all_free()


def test_token_fairness_admits_the_tenant_with_the_least_service_first() -> None:
    a, b = Tenant("a"), Tenant("b")
    h = Harness(max_num_seqs=1, fairness="tokens")
    for i in range(3):
        h.add(f"a{i}", prompt(6, start=10 * i + 10), _long(8), tenant=a)
    h.add("b0", prompt(3, start=90), _long(2), tenant=b)
    first = _first_step_of(h, ["a0", "a1", "a2", "b0"])
    # a0 arrived first; once it has been served, b (no service yet) goes before a's next ones.
    assert sorted(first, key=first.get) == ["a0", "b0", "a1", "a2"]


def test_without_fairness_the_same_requests_run_in_arrival_order() -> None:
    h = Harness(max_num_seqs=1)
    for i in range(3):
        h.add(f"a{i}", prompt(6, start=10 * i + 10), _long(8), tenant=Tenant("a"))
    h.add("b0", prompt(3, start=90), _long(2), tenant=Tenant("b"))
    first = _first_step_of(h, ["a0", "a1", "a2", "b0"])
    assert sorted(first, key=first.get) == ["a0", "a1", "a2", "b0"]


def test_weighted_tenants_are_served_in_proportion() -> None:
    heavy, light = Tenant("heavy", 2.0), Tenant("light", 1.0)
    h = Harness(max_num_seqs=1, max_num_batched_tokens=64, fairness="tokens")
    tenant_of = {}
    for i in range(30):
        for name, t in ((f"h{i}", heavy), (f"l{i}", light)):
            tenant_of[h.add(name, prompt(2, start=10), _long(6), tenant=t).seqs[0].seq_id] = t.name
    served = {"heavy": 0, "light": 0}
    for _ in range(120):  # long before either tenant runs out of requests
        for seq_id, n in h.step().out.num_scheduled_tokens.items():
            served[tenant_of[seq_id]] += n
    assert served["heavy"] / served["light"] == pytest.approx(2.0, rel=0.15)


def _req(h: Harness, name: str, tenant: Tenant):
    return h.add(name, prompt(2), _long(1), tenant=tenant)


def test_a_new_or_returning_tenant_starts_at_the_least_service_among_those_served() -> None:
    h = Harness(fairness="tokens")
    f: TokenFairness = h.sched.fairness
    a, b, c = Tenant("a"), Tenant("b"), Tenant("c")
    ra = _req(h, "a0", a)
    f.charge(ra, 100)
    rb = _req(h, "b0", b)  # new: at a's 100, not 0 (no credit for having been away)
    assert f.service("b") == 100
    f.charge(rb, 50)
    h.sched.abort_request("b0")  # b leaves ahead (150) of the floor: kept
    f.charge(ra, 20)  # a at 120
    _req(h, "b1", b)
    assert f.service("b") == 150  # it keeps what it was ahead by
    rc = _req(h, "c0", c)
    assert f.service("c") == 120
    f.charge(rc, 500)
    h.sched.abort_request("a0")  # a leaves at 120, the floor: forgotten
    assert f.num_tracked == 2
    _req(h, "a1", a)
    assert f.service("a") == 150  # back at the least service among b (150) and c (620)


def test_returning_to_an_idle_engine_earns_nothing_from_history() -> None:
    h = Harness(fairness="tokens")
    f: TokenFairness = h.sched.fairness
    a, b = Tenant("a"), Tenant("b")
    ra = _req(h, "a0", a)
    rb = _req(h, "b0", b)
    f.charge(ra, 10)
    f.charge(rb, 400)
    h.sched.abort_request("a0")
    h.sched.abort_request("b0")
    _req(h, "a1", a)  # nobody is served: a starts at the most any tenant had, level with b when it returns
    _req(h, "b1", b)
    assert f.service("a") == f.service("b") == 400
