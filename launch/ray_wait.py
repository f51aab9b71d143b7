"""Wait until a Ray cluster has a given number of alive nodes (``meshrl_wait_for_ray`` in common.sh).

    python launch/ray_wait.py --address HEAD_IP:PORT --nodes N --timeout SECONDS

Connects as a driver (retrying while the head is still starting), polls the node table, and exits 0
once ``--nodes`` nodes are alive; after ``--timeout`` seconds it exits 1 naming the nodes that did
join, so a Slurm job whose worker nodes never came up fails instead of waiting forever.
Must run on a machine that is itself a node of the cluster (the head node in launch/'s scripts).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def alive_nodes(ray) -> list[str]:
    return sorted(node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="the head's GCS address, IP:PORT")
    parser.add_argument("--nodes", type=int, required=True, help="alive nodes to wait for")
    parser.add_argument("--timeout", type=float, required=True, help="seconds before giving up")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    deadline = time.monotonic() + args.timeout
    while True:
        try:
            ray.init(address=args.address, log_to_driver=False, logging_level="WARNING")
            break
        except (ConnectionError, RuntimeError) as exc:
            if time.monotonic() > deadline:
                print(f"ray_wait: could not connect to {args.address} within {args.timeout:.0f} s: {exc}",
                      file=sys.stderr)
                return 1
            time.sleep(2)
    try:
        while True:
            nodes = alive_nodes(ray)
            if len(nodes) >= args.nodes:
                print(f"ray_wait: {len(nodes)} node(s) alive: {', '.join(nodes)}")
                return 0
            if time.monotonic() > deadline:
                print(f"ray_wait: only {len(nodes)} of {args.nodes} node(s) joined {args.address} within "
                      f"{args.timeout:.0f} s: {', '.join(nodes) or 'none'}", file=sys.stderr)
                return 1
            time.sleep(1)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
