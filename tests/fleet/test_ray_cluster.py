"""RayFleet over Ray's local multi-node test cluster: replicas spread one per node, weights
over TCP between nodes, and a node removed mid-generation."""

from __future__ import annotations

import threading
import time

import pytest
from fixtures import wait_until, write_tiny_chat_model
from safetensors.torch import load_file

from hotswap.engine import Engine
from hotswap.weight_sync import WeightSender
from hotswap.weight_sync.group import free_port

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from hotswap.fleet import RayFleet  # noqa: E402

pytestmark = pytest.mark.slow

KW = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096}
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
PROMPTS = ["The quick brown fox", "A rollout engine samples"]
FAST_HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
               "health_check_failure_threshold": 3}


@pytest.fixture
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1,
                                                      "_system_config": FAST_HEALTH})
    workers = [c.add_node(num_cpus=1) for _ in range(2)]
    ray.init(address=c.address)
    try:
        yield c, workers
    finally:
        ray.shutdown()
        c.shutdown()


def test_spread_replicas_on_nodes_and_a_removed_node(cluster, tmp_path):
    c, workers = cluster
    a = write_tiny_chat_model(str(tmp_path / "a"), seed=0)
    b = write_tiny_chat_model(str(tmp_path / "b"), seed=1)
    with Engine(b, **KW) as engine:
        want_b = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
    with RayFleet(a, replicas=2, engine_kwargs=KW, placement="spread",
                  health_period_s=0.5) as fleet:
        nodes = [r["node_id"] for r in fleet.replicas_info()]
        assert len(set(nodes)) == 2
        # The trainer (here, on the head's process) broadcasts over TCP to both nodes.
        sender = WeightSender("127.0.0.1", free_port(), world_size=3, backend="gloo")
        sender.send(load_file(f"{b}/model.safetensors"), [fleet], weight_version="b")
        sender.close([fleet])
        assert [o["output_ids"] for o in fleet.generate(PROMPTS, GREEDY)] == want_b

        # Remove the node of a replica that is not on the head node.
        by_id = {w.node_id: w for w in workers}
        victim = next(r for r in fleet.replicas_info() if r["node_id"] in by_id)
        result: dict = {}
        long = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
        prompts = [f"{p} {i}" for i in range(8) for p in PROMPTS]
        worker = threading.Thread(target=lambda: result.update(
            outs=fleet.generate(prompts, long)))
        worker.start()
        time.sleep(0.5)
        c.remove_node(by_id[victim["node_id"]])
        worker.join(timeout=180)
        assert not worker.is_alive()
        assert len(result["outs"]) == len(prompts)
        assert all(len(o["output_ids"]) == 200 for o in result["outs"])

        def replaced() -> bool:
            infos = fleet.replicas_info()
            return ([r["state"] for r in infos] == ["serving", "serving"]
                    and victim["index"] not in {r["index"] for r in infos})

        assert wait_until(replaced, 120), fleet.replicas_info()
        infos = fleet.replicas_info()
        assert victim["node_id"] not in {r["node_id"] for r in infos}
        assert len({r["node_id"] for r in infos}) == 2
        assert {r["weight_version"] for r in infos} == {"b"}
        assert [o["output_ids"] for o in fleet.generate(PROMPTS * 2, GREEDY)] == want_b * 2
