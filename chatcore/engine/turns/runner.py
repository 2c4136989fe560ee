"""The turn runner: the agent loop (C8) over a provider, with tools, step boundaries for
steer/inject (C4, C5), one overflow recovery (C7), and a latest-wins snapshot (D1).

The runner keeps its progress on itself (`pending`, `snapshot`), so when the engine cancels
it (C6) the committed-so-far messages and the partial text are still at hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from chatcore.common.llm_models import DEMO_MODEL
from sessions_app.models import MessageKind, MessageStatus

from ..provider_errors import answer_token_limit, merge_usage
from ..provider_types import ChatProvider, Completion, ProviderError, ProviderEvent, TextDelta
from ..tools import ToolContext, ToolRegistry
from .builder import PreparedInput, RuntimeInfo, TurnInputBuilder
from .items import message_to_openai
from .outcome import Completed, Failed, FailureKind, Notice, PendingMessage, TurnOutcome

logger = logging.getLogger(__name__)


@dataclass
class ToolProgress:
    call_id: str
    name: str
    status: str = "running"

    def as_dict(self) -> dict[str, str]:
        return {"call_id": self.call_id, "name": self.name, "status": self.status}


@dataclass
class TurnSnapshot:
    """Latest-wins view of a running turn: the answer so far (append-only, so clients can
    apply tails by offset) and tool progress. `changed` wakes the coalescing publisher."""

    turn_id: str
    tools: list[ToolProgress] = field(default_factory=list)
    version: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Set once the turn's first frame is on its way (the channel layer took it), by the
    # turn's publisher (`snapshots.publish_snapshots`); made by the worker before the runner
    # starts (`TurnRuns._run_cancellable`). None: nobody publishes, nothing to wait for.
    first_sent: asyncio.Event | None = None
    # The answer as pieces, joined only when read (at most a few times a second): appending
    # to one growing string would copy the whole answer at every token (STYLE 18).
    _pieces: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _bump(self) -> None:
        self.version += 1
        self.changed.set()

    def append_text(self, piece: str) -> None:
        self._pieces.append(piece)
        self._bump()

    def tool_started(self, call_id: str, name: str) -> None:
        self.tools.append(ToolProgress(call_id, name))
        self._bump()

    def tool_finished(self, call_id: str, ok: bool) -> None:
        for t in self.tools:
            if t.call_id == call_id:
                t.status = "ok" if ok else "error"
        self._bump()

    def tools_dicts(self) -> list[dict[str, str]]:
        return [t.as_dict() for t in self.tools]


StagedFetch = Callable[[], Awaitable[list[PendingMessage]]]

# E5: finish reasons that mean the answer is not whole, and the message status they give.
CUT_STATUSES = {
    "length": MessageStatus.TRUNCATED,
    "max_tokens": MessageStatus.TRUNCATED,
    "content_filter": MessageStatus.FILTERED,
}


# A stream read from buffered bytes does not suspend between deltas: give the event loop a
# turn (the snapshot publisher, the sockets, other turns) after this many of them.
DELTAS_PER_YIELD = 32
# After a step's first delta the loop gets this many turns: enough to carry its snapshot from
# the publisher through the channel layer and the consumer to the socket before the rest of a
# burst is parsed (the first token is not held back by the answer's length).
FIRST_DELTA_YIELDS = 5
# After the turn's first delta, the rest of a burst waits (at most this long) until the
# channel layer took the first frame: on Redis that takes a round trip, which a few turns of
# the loop do not cover, and the first token would otherwise wait for the whole answer to be
# parsed (`TurnSnapshot.first_sent`).
FIRST_FRAME_WAIT_SECONDS = 0.05


@dataclass(frozen=True)
class FirstRequest:
    """What a turn's first model request asks for, from the turn's input (`TurnRunner.run`'s
    first step; an `OpenedRequest` makes the same one before the runner exists)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int
    # H4: the dialog's model (None: the provider's own).
    model: str | None = None

    @classmethod
    def of(
        cls,
        prepared: PreparedInput,
        *,
        builder: TurnInputBuilder,
        tools: ToolRegistry,
        max_steps: int,
        answer_tokens: int | None = None,
    ) -> FirstRequest:
        return cls(
            messages=prepared.messages.copy(),  # its join kept (`EncodedMessages`)
            tools=None if max_steps <= 1 else (tools.schemas() or None),
            max_tokens=answer_token_limit(
                context_window=prepared.context_window or builder.context_window,
                input_tokens=prepared.estimated_tokens,
                configured=settings.LLM["MAX_TOKENS"] if answer_tokens is None else answer_tokens,
            ),
            model=prepared.model,
        )


# The end of a stream, as `anext` returns it to the task reading an opened request's first event.
_ENDED = object()


class OpenedRequest:
    """A turn's first model request, sent before its runner asks for it (G6): from the
    moment the turn's admission committed and its input was built, while the turn goes to
    its worker, so the model works meanwhile. A task of its own sends it and reads its first
    event (a provider error included, retries and all, as the runner's own request would);
    the runner then takes the stream from there (`take`), or it is closed unread (`aclose`),
    which frees its model slot and its connection. Made and used on the event loop."""

    def __init__(
        self,
        provider: ChatProvider,
        prepared: PreparedInput,
        request: FirstRequest,
        *,
        ahead: Any = None,
    ):
        """`ahead`: the provider's request for `request`, made already (its
        `prepare_request`), sent as it is."""
        self.prepared = prepared
        self.request = request
        # Only to a provider that made it: the others take no such argument.
        made = {} if ahead is None else {"prepared": ahead}
        self._stream = provider.stream(
            messages=request.messages,
            tools=request.tools,
            purpose="turn",
            max_tokens=request.max_tokens,
            model=request.model,
            **made,
        )
        self._first: asyncio.Task[Any] = asyncio.ensure_future(anext(self._stream, _ENDED))
        self.taken = False

    def take(self) -> AsyncIterator[ProviderEvent]:
        """The stream, from its first event on (once)."""
        assert not self.taken
        self.taken = True
        return self._events()

    async def _events(self) -> AsyncIterator[ProviderEvent]:
        # Cancelled while it waits, the first read is cancelled with it (and the stream with
        # that read).
        first = await self._first
        if first is _ENDED:
            return
        yield first
        async for event in self._stream:
            yield event

    async def aclose(self) -> None:
        """Close a request nobody took: its first read cancelled, its stream closed. The
        read's own outcome is dropped; a cancellation of the caller goes on as it came."""
        if self.taken:
            return
        self.taken = True
        self._first.cancel()
        await asyncio.wait([self._first])
        if not self._first.cancelled():
            self._first.exception()  # read: an error nobody took is not logged as lost
        with contextlib.suppress(Exception):
            await self._stream.aclose()  # type: ignore[attr-defined]


class TurnRunner:
    def __init__(
        self,
        *,
        provider: ChatProvider,
        tools: ToolRegistry,
        builder: TurnInputBuilder,
        snapshot: TurnSnapshot,
        tool_context: ToolContext,
        fetch_staged: StagedFetch,
        runtime: RuntimeInfo,
        session_pk: str,
        max_steps: int,
        exclude_turn_partials: str | None = None,
        continues: str | None = None,
        lead: list[PendingMessage] | None = None,
        answer_tokens: int | None = None,
        opened: OpenedRequest | None = None,
    ) -> None:
        self.provider = provider
        self.tools = tools
        self.builder = builder
        self.snapshot = snapshot
        self.tool_context = tool_context
        self.fetch_staged = fetch_staged
        self.runtime = runtime
        self.session_pk = session_pk
        self.max_steps = max_steps
        self.exclude_turn_partials = exclude_turn_partials
        self.pending: list[PendingMessage] = []
        # The step's text as pieces, joined when read (not copied at every token).
        self._step: list[str] = []
        self.usage: dict[str, Any] = {}
        self.recovered = False
        # E5: a continuation turn links its answer to the cut message it goes on with; `lead`
        # is model input of this turn that is never committed (the continue instruction).
        self.continues = continues
        self.lead = list(lead or [])
        self.answer_tokens = settings.LLM["MAX_TOKENS"] if answer_tokens is None else answer_tokens
        self.input_tokens = 0
        # H4: the dialog's model and its window, from the turn's input (`_run`).
        self.model: str | None = None
        self.context_window = builder.context_window
        # Model input recorded during the turn (tool calls, results, steers) and not yet in
        # `input_tokens`: counted when a next request needs it, off the loop (F7).
        self._uncounted: list[dict[str, Any]] = []
        # The first request, already sent for this turn's input (`OpenedRequest`): the first
        # step takes it when it asks for the same; otherwise it is closed.
        self.opened = opened

    @property
    def step_text(self) -> str:
        if len(self._step) > 1:
            self._step[:] = ["".join(self._step)]
        return self._step[0] if self._step else ""

    @step_text.setter
    def step_text(self, value: str) -> None:
        self._step = [value] if value else []

    @property
    def partial(self) -> str:
        """Text of the step in progress (what a cancel keeps as a partial message)."""
        return self.step_text

    async def run(self, prepared: PreparedInput) -> TurnOutcome:
        try:
            return await self._run(prepared)
        finally:
            if self.opened is not None:
                await self.opened.aclose()  # not taken (or taken: nothing to do)

    async def _run(self, prepared: PreparedInput) -> TurnOutcome:
        first = FirstRequest.of(
            prepared,
            builder=self.builder,
            tools=self.tools,
            max_steps=self.max_steps,
            answer_tokens=self.answer_tokens,
        )
        messages = first.messages
        self.input_tokens = prepared.estimated_tokens
        self.model = prepared.model
        self.context_window = prepared.context_window or self.builder.context_window
        self._uncounted.clear()
        opened = self.opened
        if opened is not None and (
            opened.prepared is not prepared
            or (opened.request.tools, opened.request.max_tokens, opened.request.model)
            != (first.tools, first.max_tokens, first.model)
        ):
            # Opened for other input or with other limits: not this turn's first request.
            await opened.aclose()
        step = 0
        while True:
            step += 1
            last_step = step >= self.max_steps
            tools = (
                first.tools if step == 1 else None if last_step else self.tools.schemas() or None
            )
            try:
                completion = await self._one_request(messages, tools)
            except ProviderError as exc:
                if exc.kind == "context_overflow" and not self.recovered and not self.step_text:
                    # C7: rebuild through the same path with a tighter budget, once per turn.
                    self.recovered = True
                    logger.info("context overflow; rebuilding input with a tighter budget")
                    prepared = await self.builder.recover_after_overflow(
                        session_pk=self.session_pk,
                        runtime=self.runtime,
                        pending=self.lead + self.pending,
                        exclude_turn_partials=self.exclude_turn_partials,
                    )
                    messages = prepared.messages.copy()
                    self.input_tokens = prepared.estimated_tokens
                    self._uncounted.clear()
                    step -= 1
                    continue
                if exc.kind == "content_filter":
                    # E5: a filter that speaks as an error ends the answer like a filter stop.
                    return self._cut_answer(self.step_text, MessageStatus.FILTERED)
                return Failed(
                    FailureKind.TOO_LARGE if exc.kind == "too_large" else FailureKind.PROVIDER,
                    detail=str(exc),
                    messages=self.pending,
                    partial=self.step_text,
                    provider_kind=exc.kind,
                )
            self._add_usage(completion.usage)
            text = completion.text
            cut = CUT_STATUSES.get(completion.finish_reason)
            if cut is not None:
                # E5: a cut answer is committed as such and ends the turn; tool calls cut
                # with it are not run (their arguments may be incomplete).
                return self._cut_answer(text, cut)
            empty_answer = False
            if completion.tool_calls:
                call_msg = PendingMessage(
                    role="assistant",
                    content=text,
                    kind=MessageKind.ASSISTANT,
                    tool_calls=[c.as_openai() for c in completion.tool_calls],
                )
                self._record(call_msg, messages)
                self.step_text = ""
                for call in completion.tool_calls:
                    self.snapshot.tool_started(call.id, call.name)
                    ok, result = await self.tools.call(call.name, call.arguments, self.tool_context)
                    self.snapshot.tool_finished(call.id, ok)
                    self._record(
                        PendingMessage(
                            role="tool",
                            content=result,
                            kind=MessageKind.TOOL_RESULT,
                            tool_call_id=call.id,
                            tool_name=call.name,
                        ),
                        messages,
                    )
            elif text.strip():
                self._record(self._answer(text), messages)
                self.step_text = ""
            else:
                # E5: an empty answer is never stored (nor replayed to the model).
                empty_answer = True
                self.step_text = ""
            # Step boundary: staged steer/inject take their place here, in order (C4, C5).
            staged = await self.fetch_staged()
            steered = False
            for item in staged:
                self._record(item, messages)
                steered = steered or item.kind == MessageKind.STEER
            if completion.tool_calls and not last_step:
                continue
            if steered and not last_step:
                # C4: a steer causes one more step.
                continue
            return Completed(
                messages=self.pending,
                usage=self.usage,
                notice=Notice.EMPTY if empty_answer else "",
                model=self.asked_model(),
            )

    def _answer(self, text: str, status: str = "") -> PendingMessage:
        source = {"continues": self.continues} if self.continues else {}
        return PendingMessage(
            role="assistant",
            content=text,
            kind=MessageKind.ASSISTANT,
            status=status,
            source=source,
        )

    def _cut_answer(self, text: str, status: str) -> Completed:
        """E5: the answer the model stopped early; marked, never passed off as complete."""
        self.step_text = ""
        if text.strip():
            self.pending.append(self._answer(text, status))
            notice = Notice.TRUNCATED if status == MessageStatus.TRUNCATED else Notice.FILTERED
        else:
            notice = Notice.FILTERED if status == MessageStatus.FILTERED else Notice.EMPTY
        return Completed(
            messages=self.pending, usage=self.usage, notice=notice, model=self.asked_model()
        )

    def asked_model(self) -> str:  # H4: the dialog's model, else the provider's own
        return self.model or getattr(self.provider, "model", None) or DEMO_MODEL

    def max_tokens(self) -> int:
        return answer_token_limit(
            context_window=self.context_window,
            input_tokens=self.input_tokens,
            configured=self.answer_tokens,
        )

    async def _one_request(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> Completion:
        started = time.monotonic()
        await self._count_recorded()
        if self.pending and self.snapshot.text and not self.snapshot.text.endswith("\n\n"):
            separator_pending = True
        else:
            separator_pending = False
        opened = self.opened
        if opened is not None and not opened.taken:
            # The first step's request, sent already for this input with these limits.
            stream = opened.take()
        else:
            stream = self.provider.stream(
                messages=messages,
                tools=tools,
                purpose="turn",
                max_tokens=self.max_tokens(),
                model=self.model,
            )
        # Deltas until the loop gets a turn: 0 at first, so the turn's first snapshot goes out
        # at once (F7: a model that sends its answer in one burst never holds the event loop,
        # and every other stream and socket of the process, for its whole length).
        until_yield = 0
        first = True
        async for event in stream:
            if isinstance(event, TextDelta):
                if separator_pending:
                    # The snapshot is append-only; separate the steps' texts once.
                    self.snapshot.append_text("\n\n")
                    separator_pending = False
                self._step.append(event.text)
                self.snapshot.append_text(event.text)
                if until_yield == 0:
                    sent = self.snapshot.first_sent
                    if first and sent is not None and not sent.is_set():
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(sent.wait(), FIRST_FRAME_WAIT_SECONDS)
                    for _ in range(FIRST_DELTA_YIELDS if first else 1):
                        await asyncio.sleep(0)
                    first = False
                    until_yield = DELTAS_PER_YIELD
                until_yield -= 1
            elif isinstance(event, Completion):
                logger.debug("model step took %.3fs", time.monotonic() - started)
                return event
        raise ProviderError("bad_response", "the model stream ended without a result")

    def _record(self, message: PendingMessage, messages: list[dict[str, Any]]) -> None:
        self.pending.append(message)
        item = message_to_openai(message)
        messages.append(item)
        self._uncounted.append(item)

    async def _count_recorded(self) -> None:
        """Add what was recorded since the last request to `input_tokens`, in a worker
        thread: a long answer or tool result is never tokenized on the event loop (F7), and
        the answer that ends the turn is never counted at all."""
        if not self._uncounted:
            return
        items, self._uncounted = self._uncounted, []
        builder, model = self.builder, self.model

        def count() -> int:
            counter = builder.counter_for(model)  # C7: the dialog's model's tokenizer
            return sum(counter.count_message(item) for item in items)

        self.input_tokens += await asyncio.to_thread(count)

    def _add_usage(self, usage: dict[str, Any]) -> None:
        merge_usage(self.usage, usage)
