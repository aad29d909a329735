"""Moves that make room, under a seeded random workload: the real scheduler cycle, defrag on, against the database.

Each seed plays 250 random steps on the demo cluster's two 8-GPU H100 nodes: submit a job (1-GPU ones, which
may move, 2x2-GPU gangs required on one node, and one-replica jobs of 3 to 8 GPUs, from three tenants), run a
cycle, play the launch of an admitted job, end a running attempt succeeded (a big job more often than a small
one: what is left is holes beside the small jobs that stay), or play the stop of a preempted job (its attempt
ends preempted, exit code 75, as a checkpointed stop does). A random mix alone strands few jobs (FGD keeps
nodes whole), so with nothing queued most big jobs ask for a size that fits on no node as the cluster is but
would after a move (`_awkward`). Even so moves are rare events: these seeds make 2 to 3 each (of 8 seeds
tried, 0 to 3). No process and no worker: the launcher and the backend are played (tests.support.jobs). Each
step commits as in production (a transactional test: the invariant checker reads in a REPEATABLE READ
transaction of its own), and the messages sent after commit (launches, stops, kicks) are caught before they
reach the broker.

After every step it checks what a move must never break:
- quota and capacity: no tenant holds, or has kept for it by a pin, more than its max; no flavor more than
  its capacity;
- GPUs: none is held twice by open attempts; a live pin overlaps no other pin, and no other job's open
  attempt but the stopping mover moved out of it for that very room;
- topology: a gang required on one node is placed (and pinned) on one node;
- no job lost or run twice: at most one open attempt per job; a moved job's next attempt is at its pin, and
  so is the next attempt of the job the room was made for;
- ``tests.support.invariants.check`` finds nothing (its rule 8 is the pins' own);
- each mover is told to stop after the commit that moved it;
- globex turned moves off: none of its jobs is ever moved.
Then it drains the cluster (launches played, running attempts ended succeeded, stops played, cycles run)
until every job it submitted has succeeded, and checks that moves happened and that moved jobs resumed at
their pins and finished.
"""

import random
from collections import Counter, defaultdict

import pytest
from django.utils import timezone

from portal.celery import app
from quotas.models import Quota
from runners.clusters.registry import get_backend
from runners.jobs import attempts
from runners.jobs.models import JOB_FINAL_STATES, JOB_HOLDING_STATES, AttemptOutcome, Job, JobAttempt, JobState
from runners.scheduling import services as scheduling
from runners.scheduling.models import JobMove
from tenants.models import Membership, Tenant
from tests.support import invariants
from tests.support.jobs import give_quota, play_launch, ready_environment, submit

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

SEEDS = (3, 4, 7)
STEPS = 250
ONE_NODE = {"level": "none", "mode": "required"}
SAME_NODE = {"level": "node", "mode": "required"}
# Non-final jobs at most, and queued ones: past these a submit step is not offered (the steps stay quick).
LIVE_JOBS_MAX = 12
QUEUED_MAX = 3
# The big one-replica jobs' sizes, and how often a big job's size is one that fits on no node now but would
# after a move (when there is one): what makes the workload strand big jobs often enough to see many moves.
BIG = (3, 4, 5, 6, 7, 8)
AWKWARD_SHARE = 0.8
# How often an end step ends a big job (more than one GPU) when one runs.
BIG_ENDS_FIRST = 0.7
# How often each kind of step is taken, among those that can be taken now.
WEIGHTS = {"submit": 3, "cycle": 3, "launch": 6, "end": 3, "stop": 3}


@pytest.fixture
def sent(monkeypatch):
    """The tasks sent after commit, by name: their arguments, in order. Caught here, never published."""
    caught: dict[str, list] = defaultdict(list)
    monkeypatch.setattr(app, "send_task", lambda name, args=(), **_: caught[name].append(tuple(args)))
    return caught


@pytest.fixture
def world(flavors, tenant, other_tenant, owner, outsider, acme_env, globex_env, make_user):
    """Three tenants on the H100 flavor: acme and initech allow moves, globex turned them off."""
    initech = Tenant.objects.create(slug="initech", name="Initech")
    boss = make_user("bill")
    Membership.objects.create(user=boss, tenant=initech, role="owner")
    initech_env = ready_environment(actor=boss, tenant=initech, name="models")
    other_tenant.allow_moves = False
    other_tenant.save()
    h100 = flavors["h100-80gb"]
    give_quota(tenant, h100, guaranteed=6, max=16)
    give_quota(other_tenant, h100, guaranteed=4, max=16)
    give_quota(initech, h100, guaranteed=4, max=16)
    return {"acme": (owner, acme_env), "globex": (outsider, globex_env), "initech": (boss, initech_env)}


def _submit(rng: random.Random, world, count: int) -> Job:
    """Mostly 1-GPU jobs (the ones that may move), some 2x2-GPU gangs on one node, and big one-replica jobs."""
    slug = rng.choice(sorted(world))
    actor, environment = world[slug]
    shape, name = rng.random(), f"job-{count}"
    if shape < 0.45:
        return submit(actor, environment, name=name, replicas=1, gpus_per_replica=1, topology=ONE_NODE)
    if shape < 0.55:
        return submit(actor, environment, name=name, replicas=2, gpus_per_replica=2, topology=SAME_NODE)
    sizes = list(BIG)
    # Only with nothing queued: a waiting job holds the idle GPUs for itself (admission's reservation), and the
    # awkward job would wait for them by count, never reaching placement.
    if rng.random() < AWKWARD_SHARE and not Job.objects.filter(state=JobState.QUEUED).exists():
        sizes = _awkward(sizes) or sizes
    return submit(actor, environment, name=name, replicas=1, gpus_per_replica=rng.choice(sizes), topology=ONE_NODE)


def _awkward(sizes) -> list[int]:
    """The sizes that fit on no node now (free GPUs as open attempts and pins leave them) but would on one
    node after one or two 1-GPU jobs that may move went to the other."""
    free = _free_per_node()
    movers = Counter()
    for job in Job.objects.filter(state=JobState.RUNNING, replicas=1, gpus_per_replica=1, tenant__allow_moves=True):
        if not job.moves.exists():
            movers[_open_attempt(job.id).placement[0]["node"]] += 1
    found = []
    for k in sizes:
        if not max(free.values()) < k <= sum(free.values()):
            continue
        for x in free:
            y = [n for n in free if n != x][0]
            if any(free[x] + m >= k and m <= movers[x] and m <= free[y] for m in (1, 2)):
                found.append(k)
                break
    return found


def _free_per_node() -> dict[str, int]:
    used = Counter()
    for placement in JobAttempt.objects.filter(ended_at__isnull=True).values_list("placement", flat=True):
        for replica in placement:
            used[replica["node"]] += len(replica["gpus"])
    for placement in Job.objects.filter(pinned_placement__isnull=False, state=JobState.QUEUED).values_list("pinned_placement", flat=True):
        for replica in placement:
            used[replica["node"]] += len(replica["gpus"])
    return {node: 8 - used[node] for node in ("h100-node-1", "h100-node-2")}


def _gpus(placement) -> set[tuple[str, int]]:
    return {(replica["node"], gpu) for replica in placement or () for gpu in replica["gpus"]}


def _open_attempt(job_id: int) -> JobAttempt:
    return JobAttempt.objects.get(job_id=job_id, ended_at__isnull=True)


class Run:
    """One seed's run: the random steps, what the moves promised (their pins), and the checks after each step."""

    def __init__(self, seed: int, world, flavor, sent):
        self.seed, self.world, self.flavor, self.sent = seed, world, flavor, sent
        self.rng = random.Random(seed)
        self.backend = get_backend()
        self.base = invariants.baseline()
        self.where = ""
        self.submitted: list[int] = []
        self.seen_move = 0
        # Per move: the mover, its pin, the attempt it was stopped in; the job the room was for and its pin.
        self.promises: dict[int, dict] = {}
        self.resumed_at_pin: set[int] = set()  # movers whose next attempt was at their pin
        self.room_used: set[int] = set()  # jobs a room was made for, admitted there

    # --- The steps ---

    def step(self, number: int) -> None:
        states = Counter(Job.objects.exclude(state__in=JOB_FINAL_STATES).values_list("state", flat=True))
        offered = {
            "submit": sum(states.values()) < LIVE_JOBS_MAX and states[JobState.QUEUED] < QUEUED_MAX,
            "cycle": True,
            "launch": states[JobState.ADMITTED] > 0,
            "end": states[JobState.RUNNING] > 0,
            "stop": states[JobState.PREEMPTED] > 0,
        }
        kinds = [kind for kind in WEIGHTS if offered[kind]]
        action = self.rng.choices(kinds, weights=[WEIGHTS[kind] for kind in kinds])[0]
        self.where = f"seed {self.seed} step {number} ({action})"
        if action == "submit":
            self.submitted.append(_submit(self.rng, self.world, len(self.submitted)).id)
        elif action == "cycle":
            self.cycle()
        elif action == "launch":
            play_launch(self._pick(JobState.ADMITTED))
        elif action == "end":
            # Big jobs end more often than small ones: what they leave is holes beside the small jobs that stay.
            running = list(Job.objects.filter(state=JobState.RUNNING).order_by("id"))
            big = [job for job in running if job.units > 1]
            self.end(self.rng.choice(big if big and self.rng.random() < BIG_ENDS_FIRST else running),
                     AttemptOutcome.SUCCEEDED, 0)
        else:
            self.end(self._pick(JobState.PREEMPTED), AttemptOutcome.PREEMPTED, 75)
        self.check()

    def _pick(self, state: str) -> Job:
        return self.rng.choice(list(Job.objects.filter(state=state).order_by("id")))

    def cycle(self) -> None:
        stops = len(self.sent["runners.tasks.job_stop"])
        scheduling.cycle_run()
        stopped = {args[0] for args in self.sent["runners.tasks.job_stop"][stops:]}
        # The moves this cycle made, with the pins it wrote: what the movers and the rooms' jobs are promised.
        for move in JobMove.objects.filter(id__gt=self.seen_move).order_by("id"):
            self.seen_move = move.id
            mover = Job.objects.get(id=move.job_id)
            waiting = Job.objects.get(id=move.for_job_id)
            assert mover.state == JobState.PREEMPTED and mover.pinned_placement, (
                f"{self.where}: job {mover.id} moved but it is {mover.state}, pin {mover.pinned_placement}")
            assert waiting.state == JobState.QUEUED and waiting.pinned_placement, (
                f"{self.where}: room made for job {waiting.id} but it is {waiting.state}, pin {waiting.pinned_placement}")
            assert {replica["node"] for replica in mover.pinned_placement} == {move.to_node} != {move.from_node}, (
                f"{self.where}: move {move.id} from {move.from_node} to {move.to_node}, pinned {mover.pinned_placement}")
            assert mover.id in stopped, f"{self.where}: job {mover.id} was moved but never told to stop"
            self.promises[move.id] = {
                "mover": mover.id, "pin": mover.pinned_placement, "stopped": _open_attempt(mover.id).number,
                "for": waiting.id, "room": waiting.pinned_placement, "room_attempts": waiting.attempts.count(),
            }

    def end(self, job: Job, outcome: str, exit_code: int) -> None:
        attempt = _open_attempt(job.id)
        assert attempts.attempt_end(job.id, attempt.id, outcome=outcome, reason="played", exit_code=exit_code), (
            f"{self.where}: attempt {job.id}/{attempt.number} would not end {outcome}")

    def drain(self) -> None:
        """Play out everything: launches, ends, stops and cycles until no job is queued or holds."""
        for rounds in range(60):
            self.where = f"seed {self.seed} drain round {rounds}"
            left = Job.objects.filter(state__in=[JobState.QUEUED, *JOB_HOLDING_STATES]).order_by("id")
            if not left.exists():
                return
            for job in left.filter(state=JobState.ADMITTED):
                play_launch(job)
            for job in left.filter(state=JobState.RUNNING):
                self.end(job, AttemptOutcome.SUCCEEDED, 0)
            for job in left.filter(state=JobState.PREEMPTED):
                self.end(job, AttemptOutcome.PREEMPTED, 75)
            self.cycle()
            self.check()
        stuck = Job.objects.filter(state__in=[JobState.QUEUED, *JOB_HOLDING_STATES]).values_list("id", flat=True)
        raise AssertionError(f"seed {self.seed}: the drain never ended:\n{invariants.describe(stuck)}")

    # --- The checks after each step ---

    def check(self) -> None:
        where, now = self.where, timezone.now()
        found = invariants.check(self.backend, baseline=self.base, ledger=False)
        assert found == [], f"{where}: the invariants:\n" + "\n".join(found)

        jobs = {job.id: job for job in Job.objects.select_related("tenant")}
        opened: dict[int, list[JobAttempt]] = defaultdict(list)
        for attempt in JobAttempt.objects.filter(ended_at__isnull=True):
            opened[attempt.job_id].append(attempt)
        twice = {job_id: len(rows) for job_id, rows in opened.items() if len(rows) > 1}
        assert not twice, f"{where}: jobs with more than one open attempt: {twice}"

        # Held, or kept by a pin for a queued job (admission counts both), within each max and the capacity.
        pinned = {job.id: job for job in jobs.values() if job.pinned_placement and job.pinned_until
                  and job.pinned_until > now}
        counted = [job for job in jobs.values()
                   if job.state in JOB_HOLDING_STATES or (job.state == JobState.QUEUED and job.id in pinned)]
        per_tenant = Counter()
        for job in counted:
            per_tenant[job.tenant.slug] += job.units
        maxes = dict(Quota.objects.filter(flavor=self.flavor).values_list("tenant__slug", "max"))
        over = {slug: (units, maxes[slug]) for slug, units in per_tenant.items() if units > maxes[slug]}
        assert not over, f"{where}: tenants past their max (held or kept, max): {over}"
        assert sum(per_tenant.values()) <= self.flavor.capacity, (
            f"{where}: {sum(per_tenant.values())} units held or kept, past the capacity {self.flavor.capacity}")

        # A pin overlaps no other pin, and no open attempt but the one of a mover stopping to make that room.
        held = {job_id: _gpus(rows[0].placement) for job_id, rows in opened.items()}
        moved_for = defaultdict(set)
        for mover_id, for_id in JobMove.objects.values_list("job_id", "for_job_id"):
            moved_for[for_id].add(mover_id)
        for job_id, job in pinned.items():
            pin = _gpus(job.pinned_placement)
            for other_id, other in pinned.items():
                assert other_id == job_id or not pin & _gpus(other.pinned_placement), (
                    f"{where}: the pins of jobs {job_id} and {other_id} overlap: {sorted(pin & _gpus(other.pinned_placement))}")
            for other_id, gpus in held.items():
                if other_id == job_id or not pin & gpus:
                    continue
                assert jobs[other_id].state == JobState.PREEMPTED and other_id in moved_for[job_id], (
                    f"{where}: job {job_id}'s pin {job.pinned_placement} overlaps job {other_id} "
                    f"({jobs[other_id].state}), which is not a mover stopping for it: {sorted(pin & gpus)}")

        # A gang required on one node is on one node, placed or pinned.
        for job in jobs.values():
            if job.spec["topology"] != SAME_NODE:
                continue
            for placement in ([attempt.placement for attempt in opened.get(job.id, [])]
                              + ([job.pinned_placement] if job.id in pinned else [])):
                assert len({replica["node"] for replica in placement}) == 1, (
                    f"{where}: job {job.id} is required on one node but placed {placement}")

        # Moves: never of a tenant that turned them off; each mover's next attempt, and the next attempt of the
        # job its room was for, at the pin the move promised.
        never = JobMove.objects.filter(job__tenant__allow_moves=False).values_list("job_id", flat=True)
        assert not never, f"{where}: jobs of a tenant that turned moves off were moved: {list(never)}"
        for move_id, promise in self.promises.items():
            mover = promise["mover"]
            later = JobAttempt.objects.filter(job_id=mover, number__gt=promise["stopped"]).order_by("number").first()
            if later is not None:
                assert later.placement == promise["pin"], (
                    f"{where}: job {mover}, moved (move {move_id}), was admitted at {later.placement}, not at its pin "
                    f"{promise['pin']}")
                self.resumed_at_pin.add(mover)
            room = JobAttempt.objects.filter(job_id=promise["for"]).order_by("number")[promise["room_attempts"]:][:1]
            for attempt in room:
                assert attempt.placement == promise["room"], (
                    f"{where}: job {promise['for']}, whose room was made (move {move_id}), was admitted at "
                    f"{attempt.placement}, not at its pin {promise['room']}")
                self.room_used.add(promise["for"])


@pytest.mark.parametrize("seed", SEEDS)
def test_moves_under_a_random_workload_keep_quota_capacity_topology_and_every_job(seed, world, flavors, sent):
    run = Run(seed, world, flavors["h100-80gb"], sent)
    for number in range(STEPS):
        run.step(number)
    run.drain()

    states = Counter(Job.objects.filter(id__in=run.submitted).values_list("state", flat=True))
    assert states == {JobState.SUCCEEDED: len(run.submitted)}, f"seed {seed} after the drain: {dict(states)}"
    moves = JobMove.objects.count()
    assert moves >= 2, f"seed {seed}: only {moves} moves in {STEPS} steps: the workload did not fragment"
    movers = set(JobMove.objects.values_list("job_id", flat=True))
    assert run.resumed_at_pin == movers, (
        f"seed {seed}: moved jobs never re-admitted at their pin: {sorted(movers - run.resumed_at_pin)}")
    rooms = set(JobMove.objects.values_list("for_job_id", flat=True))
    assert run.room_used == rooms, f"seed {seed}: rooms never used by their job: {sorted(rooms - run.room_used)}"
