"""``python -m meshrl.rewards.sandbox serve [--host H] [--port P] [--max-concurrent N]``: run the local
sandbox server (SandboxFusion's ``/run_code`` API, Python only) until SIGTERM/SIGINT; prints its URL."""

import argparse

from meshrl.rewards.sandbox.server import serve


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m meshrl.rewards.sandbox")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="serve POST /run_code until SIGTERM/SIGINT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0 picks a free port (printed)")
    p.add_argument("--max-concurrent", type=int, default=4, help="programs running at once")
    p.add_argument("--memory-limit-mb", type=int, default=1024, help="for requests with memory_limit_MB -1 or absent")
    p.add_argument("--python", default=None,
                   help="interpreter for the programs (default: see limits.program_interpreter)")
    args = parser.parse_args(argv)
    serve(args.host, args.port, args.max_concurrent, args.memory_limit_mb, args.python)


if __name__ == "__main__":
    main()
