"""Running the interactions of a rollout's conversations: one event loop, per-call timeouts, failures contained.

Every call of an interaction's coroutines runs on one event loop on its own thread (started with the first
call and kept for the life of the process: an interaction may hold loop-bound state across rollouts),
whichever loop (the async rollout's) or thread (the batched one) asks. ``reply(conversation)`` answers one user turn:

1. the first time, ``start_interaction(instance_id, **interaction_kwargs)`` (a new id per conversation);
2. ``generate_response(instance_id, messages, **interaction_kwargs)``.

The caller waits at most the interaction's ``timeout_s`` for both (``wait`` / ``await_reply``). A call that
raises, returns something that is not ``(bool, str, float | None, dict)``, or does not answer in time gives
an ``InteractionReply`` with ``error`` set: the agent loop ends that conversation there (finish reason
``interaction_error``) and logs the message; the step goes on. A call that timed out is cancelled; one that
blocks the loop's thread (synchronous work inside a coroutine) cannot be, and the calls queued behind it time
out as well, each ending its own conversation. ``finalize`` calls ``finalize_interaction`` once a started
conversation has ended (verl's agent loop never does, leaving the interaction's per-instance state behind).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Coroutine, Mapping

from meshrl.rollout.interactions.base import Interaction

logger = logging.getLogger(__name__)


@dataclass
class Conversation:
    """One sample's side of its interaction: which one, its ``interaction_kwargs``, the chat ``messages`` so far
    (the prompt's, then each turn's as the agent loop appends them), and the instance once started."""

    interaction: Interaction
    kwargs: Mapping[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)
    instance_id: str | None = None


@dataclass(frozen=True)
class InteractionReply:
    """One user turn: its ``text``, whether it ends the conversation, its ``score`` (None: none); or ``error``
    (the conversation ends without the turn; ``timeout`` when it did not answer in time); ``seconds`` waited."""

    text: str = ""
    terminate: bool = False
    score: float | None = None
    error: str | None = None
    timeout: bool = False
    seconds: float = 0.0


class InteractionRunner:
    """The interactions' event loop and the calls on it (module docstring)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def _submit(self, coroutine: Coroutine) -> concurrent.futures.Future:
        with self._lock:
            if self._loop is None:  # a daemon thread: it serves the agent loop until the process ends
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="meshrl-interactions", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    @staticmethod
    async def _respond(conversation: Conversation) -> InteractionReply:
        interaction, kwargs = conversation.interaction, dict(conversation.kwargs)
        if conversation.instance_id is None:
            conversation.instance_id = str(await interaction.start_interaction(uuid.uuid4().hex, **kwargs))
        answer = await interaction.generate_response(conversation.instance_id, list(conversation.messages), **kwargs)
        if not (isinstance(answer, tuple) and len(answer) == 4 and isinstance(answer[1], str)):
            raise TypeError("generate_response must return (should_terminate, text, score, extra), got "
                            f"{answer!r:.200}")
        terminate, text, score, _ = answer
        return InteractionReply(text, bool(terminate), None if score is None else float(score))

    def reply(self, conversation: Conversation) -> concurrent.futures.Future:
        """The next user turn of ``conversation`` (started now), to ``wait`` or ``await_reply`` for."""
        return self._submit(self._respond(conversation))

    def wait(self, conversation: Conversation, future: concurrent.futures.Future, started: float) -> InteractionReply:
        """``future``'s reply, or an error reply once the interaction's ``timeout_s`` since ``started`` is spent."""
        try:
            reply = future.result(timeout=max(conversation.interaction.timeout_s - (time.monotonic() - started), 0.0))
        except Exception as error:  # noqa: BLE001 - an interaction's failure ends its conversation, never the step
            future.cancel()
            return self._failed(conversation, future, error, started)
        return replace(reply, seconds=time.monotonic() - started)

    async def await_reply(self, conversation: Conversation) -> InteractionReply:
        """``reply`` + ``wait`` from a coroutine: the caller's loop runs other conversations meanwhile (at the
        timeout, ``wait_for`` cancels the call)."""
        started = time.monotonic()
        future = self.reply(conversation)
        try:
            reply = await asyncio.wait_for(asyncio.wrap_future(future), conversation.interaction.timeout_s)
        except Exception as error:  # noqa: BLE001 - as in wait()
            return self._failed(conversation, future, error, started)
        return replace(reply, seconds=time.monotonic() - started)

    @staticmethod
    def _failed(conversation: Conversation, future: concurrent.futures.Future, error: Exception, started: float
                ) -> InteractionReply:
        """The error reply for a call that raised ``error`` or, when it had not answered (or was cancelled for
        it), that timed out."""
        timeout_s = conversation.interaction.timeout_s
        timeout = future.cancelled() or not future.done()
        why = f"no answer within {timeout_s:g} s" if timeout else f"{type(error).__name__}: {error}"
        message = f"interaction {conversation.interaction.name!r} failed: {why}"
        logger.warning("%s; that sample's conversation ends here", message)
        return InteractionReply(error=message, timeout=timeout,
                                seconds=timeout_s if timeout else time.monotonic() - started)

    def finalize(self, conversations: list[Conversation]) -> None:
        """``finalize_interaction`` of every started conversation, each waited for at most its ``timeout_s``;
        a failure is logged."""
        started = time.monotonic()
        pending = [(c, self._submit(c.interaction.finalize_interaction(c.instance_id)))
                   for c in conversations if c.instance_id is not None]
        for conversation, future in pending:
            timeout_s = conversation.interaction.timeout_s
            try:
                future.result(timeout=max(timeout_s - (time.monotonic() - started), 0.0))
            except Exception as error:  # noqa: BLE001 - the conversation is over; its release failing ends nothing
                future.cancel()
                logger.warning("interaction %r: finalize_interaction(%s) failed: %s: %s", conversation.interaction.name,
                               conversation.instance_id, type(error).__name__, error)
            conversation.instance_id = None
