"""The Ray Data job of the cluster test: ``add_sub`` over every row, each worker on its own host's Triton.

Run on the head (a driver of the cluster). Makes ``--rows`` rows, row ``i``
tagged by its values (``INPUT0 = i * 16 + 0..15``, ``INPUT1`` a second pattern
of ``i``), runs them through :class:`~ray_triton_shm.data.TritonPredictor` on an
actor pool spread over the hosts (the app's node config, so the workers share
the app's node actors), and checks what comes back: every row once, every
output value right, and that each worker's Triton was the one of the node it
ran on. A batch sleeps ``--pause`` seconds so that the job spans a host loss.
Prints a JSON line of progress per batch it takes, then one of the result (rows,
missing, duplicated, wrong, rows per node, seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import numpy as np
import yaml

_WIDTH = 16


def inputs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two inputs of rows ``ids``: values only these rows carry."""
    first = (ids[:, None] * _WIDTH + np.arange(_WIDTH)).astype(np.int32)
    second = (ids[:, None] * 3 - np.arange(_WIDTH) * 5).astype(np.int32)
    return first, second


class AddSub:
    """A TritonPredictor for add_sub that also says on which node it ran and whose Triton answered."""

    def __init__(self, config, pause_s: float) -> None:
        from ray_triton_shm.data import TritonPredictor

        self._predict = TritonPredictor(model="add_sub", node_config=config)
        self._pause = pause_s

    def __call__(self, batch: dict) -> dict:
        import ray

        first, second = inputs(batch["id"])
        out = self._predict({"INPUT0": first, "INPUT1": second})
        rows = len(batch["id"])
        time.sleep(self._pause)
        return {
            "id": batch["id"],
            "OUTPUT0": out["OUTPUT0"],
            "OUTPUT1": out["OUTPUT1"],
            "node": np.array([ray.get_runtime_context().get_node_id()] * rows),
            "triton_node": np.array([self._predict._client.info.node_id] * rows),
        }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the job; print its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the Serve config whose app args the workers use")
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pause", type=float, default=0.2)
    args = parser.parse_args(argv)

    import ray

    from ray_triton_shm._private.node.node_config import split_app_args

    spec = yaml.safe_load(open(args.config))
    # The app's node settings, as the Serve app reads them (its front door is the replicas' own).
    node_args = {k: v for k, v in spec["applications"][0]["args"].items() if k != "frontdoor"}
    config, _ = split_app_args(node_args)
    ray.init(address="auto", log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    started = time.time()
    ds = ray.data.range(args.rows, override_num_blocks=max(1, args.rows // 100)).map_batches(
        AddSub,
        fn_constructor_kwargs={"config": config, "pause_s": args.pause},
        compute=ray.data.ActorPoolStrategy(size=args.workers),
        num_cpus=0.25,
        batch_size=args.batch,
        batch_format="numpy",
        scheduling_strategy="SPREAD",
    )
    seen = np.zeros(args.rows, np.int64)
    wrong = 0
    foreign = 0
    per_node: dict[str, int] = {}
    for batch in ds.iter_batches(batch_size=256, batch_format="numpy"):
        ids = batch["id"]
        np.add.at(seen, ids, 1)
        first, second = inputs(ids)
        bad = ~(
            np.all(batch["OUTPUT0"] == first + second, axis=1)
            & np.all(batch["OUTPUT1"] == first - second, axis=1)
        )
        wrong += int(bad.sum())
        foreign += int(np.count_nonzero(batch["node"] != batch["triton_node"]))
        for node, count in zip(*np.unique(batch["node"], return_counts=True)):
            per_node[str(node)] = per_node.get(str(node), 0) + int(count)
        print(json.dumps({"progress": int(seen.sum()), "at": round(time.time(), 3)}), flush=True)
    result = {
        "rows": args.rows,
        "returned": int(seen.sum()),
        "missing": int(np.count_nonzero(seen == 0)),
        "duplicated": int(np.count_nonzero(seen > 1)),
        "wrong": wrong,
        "foreign_triton": foreign,
        "per_node": per_node,
        "started": started,
        "seconds": round(time.time() - started, 1),
    }
    ray.shutdown()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
