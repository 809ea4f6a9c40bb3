"""The bytes + compute model of `benchmarks/multinode.py` (issue #34): a profiled bare-link step replayed through a
shaped link. Pure arithmetic on hand-built profiles, in process (no namespaces, no root)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "multinode.py"
_SPEC = importlib.util.spec_from_file_location("multinode_benchmark", _PATH)
multinode = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(multinode)

TICK = 0.001  # one sample a millisecond: a wait's end is known to a tick
GBIT = 1e9


def _profile(*segments: tuple[float, float, float, bool]) -> list[tuple[float, int, int, bool]]:
    """Samples from (seconds, bytes sent, bytes received, compute thread running) segments, bytes spread evenly."""
    samples, clock, sent, received = [], 0.0, 0.0, 0.0
    for seconds, tx, rx, running in segments:
        ticks = round(seconds / TICK)
        for _ in range(ticks):
            clock, sent, received = clock + TICK, sent + tx / ticks, received + rx / ticks
            samples.append((clock, int(sent), int(received), running))
    return samples


def test_the_bare_link_replays_the_profiled_step_itself():
    profile = _profile((0.2, 0, 0, True), (0.05, 3e7, 3e7, False), (0.05, 0, 0, True))
    assert multinode.replay_seconds(profile, None) == pytest.approx(0.3)


def test_a_transfer_the_step_waits_on_adds_the_link_time_less_its_bare_time():
    # DDP's one bucket: 0.2 s of backward, then a 0.05 s wait while 30 MB go each way, then 0.05 s of optimizer step
    profile = _profile((0.2, 0, 0, True), (0.05, 3e7, 3e7, False), (0.05, 0, 0, True))
    link = 3e7 * 8 / GBIT  # 0.24 s, issued at 0.2 s: the wait ends at 0.44 s, the step at 0.49 s
    assert multinode.replay_seconds(profile, GBIT) == pytest.approx(0.2 + link + 0.05, abs=TICK)


def test_transfers_beside_compute_cost_only_what_the_compute_does_not_hide():
    overlapped = _profile((0.3, 1.5e7, 1.5e7, True))  # 0.12 s of link beside 0.3 s of compute: hidden
    assert multinode.replay_seconds(overlapped, GBIT) == pytest.approx(0.3, rel=1e-3)
    assert multinode.replay_seconds(overlapped, GBIT / 10) == pytest.approx(1.2, rel=1e-2)  # link-bound


def test_a_wait_on_the_received_bytes_waits_for_the_other_nodes_queue():
    # this node sends nothing; the peer's 30 MB arrive during the wait: the peer's shaped egress is the bound
    profile = _profile((0.1, 0, 0, True), (0.02, 0, 3e7, False), (0.1, 0, 0, True))
    assert multinode.replay_seconds(profile, GBIT) == pytest.approx(0.1 + 0.24 + 0.1, abs=TICK)


def test_the_bytes_measured_at_the_rate_scale_the_replay():
    profile = _profile((0.1, 0, 0, True), (0.02, 1e7, 0, False))
    assert multinode.replay_seconds(profile, GBIT, scale=1.5) == pytest.approx(0.1 + 1.5e7 * 8 / GBIT, abs=TICK)


def test_bursts_out_of_phase_in_the_two_directions_cost_the_link_time_once():
    # a wait as gloo's rings make it: 1.5 MB bursts, sent and received in turn, 20 each way (0.24 s each at 1 Gbit/s):
    # the two directions cross at once (full duplex) and the quiet ticks between bursts add nothing
    bursts = [(TICK, 1.5e6, 0, False) if tick % 2 else (TICK, 0, 1.5e6, False) for tick in range(40)]
    profile = _profile((0.1, 0, 0, True), *bursts, (0.1, 0, 0, True))
    assert multinode.replay_seconds(profile, GBIT) == pytest.approx(0.1 + 0.24 + 0.1, abs=2 * TICK)


def test_a_wait_longer_than_its_transfer_keeps_its_bare_length():
    # 1 MB (8 ms at 1 Gbit/s) sent at the start of a 50 ms wait on the peer's compute: the wait stays 50 ms
    profile = _profile((0.1, 0, 0, True), (TICK, 1e6, 1e6, False), (0.049, 0, 0, False), (0.1, 0, 0, True))
    assert multinode.replay_seconds(profile, GBIT) == pytest.approx(0.25, abs=TICK)
