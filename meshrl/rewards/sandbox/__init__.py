"""Code rewards in a sandbox: an isolated runner (``limits``), a local server speaking SandboxFusion's
``/run_code`` API (``server``) and its client with verl's test-case scoring (``client``)."""

from meshrl.rewards.sandbox.client import SandboxUnreachable, compute_score, run_code
from meshrl.rewards.sandbox.server import local_sandbox

__all__ = ["SandboxUnreachable", "compute_score", "local_sandbox", "run_code"]
