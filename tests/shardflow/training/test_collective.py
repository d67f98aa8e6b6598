"""The collective transport's link: two devices' ends of a real gloo group in one process (a thread each);
its refusals. The engine's runs over it are in test_engine.py and tests/flows/test_faults.py."""

from __future__ import annotations

import gc
import subprocess
import threading
import time

import numpy as np
import pytest

from shardflow.config import RetrainConfig
from shardflow.errors import InputError, WorkerLost
from shardflow.training.collective import FIRST_BYTES, POSTED_BYTES, Link, Stream, open_rendezvous
from shardflow.training.config import TrainConfig, check_transport
from shardflow.training.messages import Block, Kind, Message, Round
from shardflow.training.transport import PROBE_S, EngineClosing
from support import pem_files


class Alive:
    """Stands for a peer's actor that still exists (reading `alive` succeeds)."""

    alive = True


class Gone:
    """A peer's actor released: reading `alive` fails as distributed's does."""

    @property
    def alive(self):
        raise KeyError("actor released")


@pytest.fixture
def pair():
    store, port = open_rendezvous("127.0.0.1")
    links: dict[int, Link] = {}

    def join(rank: int) -> None:
        links[rank] = Link(rank, 2, "127.0.0.1", "127.0.0.1", port, generation=1, timeout_s=30)

    joiners = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in joiners:
        t.start()
    for t in joiners:
        t.join(timeout=60)
    yield links[0], links[1]
    for link in links.values():
        link.close()
    del store


def test_messages_arrive_whole_and_in_each_rounds_order(pair):
    a, b = pair
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    a.send(1, Message(Round.REQUEST, 0, 0, [Block(Kind.LOOKUP, "item", np.array([5, 7, 9]))]))
    a.send(1, Message(Round.REPLY, 0, 0, [Block(Kind.LOOKUP, "item", np.zeros(0, np.int64), rows)],
                      dense={"w": rows[:1]}))
    a.send(1, Message(Round.REQUEST, 1, 0))
    reply = b.receive(0, Round.REPLY, Alive())  # another round's stream: not behind the requests
    first, second = b.receive(0, Round.REQUEST, Alive()), b.receive(0, Round.REQUEST, Alive())
    assert (first.step, second.step) == (0, 1) and first.blocks[0].ids.tolist() == [5, 7, 9]
    assert reply.blocks[0].values.tobytes() == rows.tobytes() and reply.dense["w"].tobytes() == rows[:1].tobytes()


def test_a_message_longer_than_its_first_piece_arrives_whole_and_the_stream_stays_in_step(pair):
    a, b = pair
    big = np.random.default_rng(0).random((FIRST_BYTES // 4 + 1000, 1), dtype=np.float32)  # over one piece
    ids = np.arange(big.shape[0], dtype=np.int64)
    for step, rows in enumerate((big, big[:3], big)):
        a.send(1, Message(Round.GRADIENTS, step, 0, [Block(Kind.LOOKUP, "item", ids[: rows.shape[0]], rows)]))
    got = [b.receive(0, Round.GRADIENTS, Alive()) for _ in range(3)]
    assert [m.step for m in got] == [0, 1, 2]
    assert [m.blocks[0].values.tobytes() for m in got] == [big.tobytes(), big[:3].tobytes(), big.tobytes()]
    assert got[2].blocks[0].ids.tolist() == ids.tolist()


def test_once_a_stream_carried_a_long_message_the_next_leaves_whole_before_its_receiver_asks(pair):
    a, b = pair
    big = np.random.default_rng(1).random((FIRST_BYTES // 4 + 1000, 1), dtype=np.float32)  # over one first piece
    ids = np.arange(big.shape[0], dtype=np.int64)
    a.send(1, Message(Round.GRADIENTS, 0, 0, [Block(Kind.LOOKUP, "item", ids, big)]))
    assert b.receive(0, Round.GRADIENTS, Alive()).step == 0  # b posts the stream's next receive, as long as this
    a.send(1, Message(Round.GRADIENTS, 1, 0, [Block(Kind.LOOKUP, "item", ids, big * 2)]))
    # in one piece into that receive: it leaves now, no rest waits for b to ask for it
    assert a.sent(timeout_s=30)
    got = b.receive(0, Round.GRADIENTS, Alive())
    assert got.step == 1 and got.blocks[0].values.tobytes() == (big * 2).tobytes()


def test_a_streams_posted_receive_grows_to_its_longest_message_by_powers_of_two_within_bounds():
    s = Stream()
    assert s.posted == FIRST_BYTES
    for length, posted in [(100, FIRST_BYTES), (FIRST_BYTES, FIRST_BYTES), (FIRST_BYTES + 1, 2 * FIRST_BYTES),
                           (3_000_000, 1 << 22), (1_000, 1 << 22), (POSTED_BYTES * 5, POSTED_BYTES)]:
        s.carried(length)
        assert s.posted == posted, (length, s.posted)


def test_a_streams_next_message_leaves_its_sender_before_the_receiver_asks_for_it(pair):
    a, b = pair
    a.send(1, Message(Round.REPLY, 0, 0))
    assert b.receive(0, Round.REPLY, Alive()).step == 0
    a.send(1, Message(Round.REPLY, 1, 0, dense={"w": np.ones((4, 4), np.float32)}))
    # gloo sends a message once its receiver has posted a receive for it: the receiver posts the stream's next
    # one as it takes a message, so a late receiver finds it in, not waiting a round trip of the two loops.
    assert a.sent(timeout_s=30)
    assert b.receive(0, Round.REPLY, Alive()).dense["w"].sum() == 16


def test_a_peers_last_message_is_given_back_though_its_connection_closed_after_it(pair):
    a, b = pair
    a.send(1, Message(Round.REPLY, 0, 0))
    b.receive(0, Round.REPLY, Alive())  # b posts the stream's next receive now
    a.send(1, Message(Round.REPLY, 1, 0, error="device 0 failed"))
    assert a.sent(timeout_s=30)
    a.close()
    a.group = None  # its pairs close their sockets
    gc.collect()
    time.sleep(2)  # b's gloo loop reads the end of the connection
    last = b.receive(0, Round.REPLY, Alive())
    assert (last.step, last.error) == (1, "device 0 failed")


def test_a_wait_ends_when_the_engine_stops_the_device(pair):
    a, b = pair
    threading.Timer(0.2, b.stop).start()
    t = time.monotonic()
    with pytest.raises(EngineClosing, match="engine is closing"):
        b.receive(0, Round.GRADIENTS, Alive())
    assert time.monotonic() - t < 5 and b.broken


def test_a_peer_whose_actor_is_gone_ends_the_wait_within_a_probe(pair):
    a, b = pair
    t = time.monotonic()
    with pytest.raises(WorkerLost, match="a peer device is gone"):
        b.receive(0, Round.TOTALS, Gone())
    assert PROBE_S <= time.monotonic() - t < PROBE_S + 5
    with pytest.raises(WorkerLost, match="formed again"):  # out of step now: nothing more on this group
        b.receive(0, Round.TOTALS, Alive())


def test_the_rendezvous_listens_on_the_host_it_is_given_only():
    store, port = open_rendezvous("127.0.0.1")
    listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    ours = [line.split()[3] for line in listening.splitlines() if line.split()[3].endswith(f":{port}")]
    assert ours == [f"127.0.0.1:{port}"], ours
    del store


def test_an_unknown_transport_or_one_with_early_answers_is_one_line():
    with pytest.raises(InputError, match="transport 'nccl'; accepted: auto, actor, collective"):
        check_transport("nccl", False)
    with pytest.raises(InputError, match="early_answers = true with transport 'collective'; accepted"):
        check_transport("collective", True)
    check_transport("collective", False)


def test_build_ahead_is_true_false_or_none_and_none_builds_ahead_on_a_gpu_only():
    with pytest.raises(InputError, match="build_ahead = 'yes'; accepted: true, false or none"):
        TrainConfig(build_ahead="yes")
    assert not TrainConfig().builds_ahead() and TrainConfig(device="cuda").builds_ahead()
    assert TrainConfig(build_ahead=True).builds_ahead()
    assert not TrainConfig(device="cuda", build_ahead=False).builds_ahead()


def test_the_config_refuses_a_collective_transport_beside_early_answers_or_tls_files(tmp_path):
    topology = tmp_path / "t.yaml"
    topology.write_text("intra_node_gbytes_per_s: 100\nnodes:\n  - {name: a, devices: 2, uplink_gbytes_per_s: 10}\n")
    base = {"topology": str(topology), "transport": "collective"}
    assert RetrainConfig.build(base).training().transport == "collective"
    for extra, refusal in (({"early_answers": True}, "early_answers = true with transport 'collective'; accepted"),
                           (pem_files(tmp_path), "transport = 'collective' with the cluster's TLS files; accepted: "
                                                 "transport 'actor'")):
        with pytest.raises(InputError, match=refusal) as e:
            RetrainConfig.build({**base, **extra})
        assert "\n" not in str(e.value)


def test_auto_is_the_collective_transport_unless_early_answers_or_tls_files_need_the_actor_calls(tmp_path):
    topology = tmp_path / "t.yaml"
    topology.write_text("intra_node_gbytes_per_s: 100\nnodes:\n  - {name: a, devices: 2, uplink_gbytes_per_s: 10}\n")
    base = {"topology": str(topology)}
    assert RetrainConfig.build(base).train.transport == "auto"  # the default
    assert RetrainConfig.build(base).training().transport == "collective"
    assert RetrainConfig.build({**base, "early_answers": True}).training().transport == "actor"
    assert RetrainConfig.build({**base, **pem_files(tmp_path)}).training().transport == "actor"
    assert RetrainConfig.build({**base, "transport": "actor"}).training().transport == "actor"
    assert TrainConfig().transport == "collective" and TrainConfig(early_answers=True).transport == "actor"
