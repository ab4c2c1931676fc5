"""What a masker is told to mask: :class:`Masking`, the mixer's settings it follows, with the opt-in
:class:`MaskPolicy` (thinking, tool calls, tool outputs taken out of the mask, beyond the reference) and
how a policy is applied to a batch's masked rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sftmix.config.config import MixerConfig
from sftmix.sources.formats import Conversation
from sftmix.tokenizing.prefix_renders import common_prefix_length
from sftmix.tokenizing.row_status import UNTRAINABLE, RowStatus, TokenizedRow
from sftmix.tokenizing.segments import Encoded
from sftmix.tokenizing.templates import ChatRenderer


@dataclass(frozen=True)
class Masking:
    """The mixer's settings a masker follows, by the mixer's own names (``sftmix.config.config.MixerConfig``:
    ``max_seq_length``, ``mask``, ``spans``, ``drop_untrainable``, ``mask_thinking``, ...), and what they
    mean for a row the plan, the slices, assembly and the report ask about."""

    max_seq_length: int | None = None
    mask: str = "assistant"
    spans: str = "reference"
    drop_untrainable: bool = False  # a row with nothing to train is dropped, so it needs no tokens
    policy: MaskPolicy = field(default_factory=lambda: MaskPolicy())  # mask_thinking, ... (defined below)

    @classmethod
    def of(cls, mixer: MixerConfig) -> Masking:
        """The mixer's settings, each under its own name."""
        policy = MaskPolicy(mixer.mask_thinking, mixer.mask_tool_calls, mixer.mask_tool_outputs)
        return cls(mixer.max_seq_length, mixer.mask, mixer.spans, mixer.drop_untrainable, policy)

    def skips_untrainable(self) -> bool:
        """Whether a row found to have nothing to train on is dropped before its tokens are counted
        (the reference's filter; exact spans may keep what the reference's span check would not)."""
        return self.drop_untrainable and self.spans != "exact"

    def keeps_untrained(self, status: RowStatus) -> bool:
        """Whether a row of ``status`` is kept with an all-zero mask (counted as such in the manifest)."""
        return not self.drop_untrainable and status in UNTRAINABLE

    def drops_masked_whole(self, over_length_strategy: str) -> bool:
        """Whether an over-length row masked whole (``over_length_strategy: drop``) is dropped, not kept."""
        return over_length_strategy == "drop" and self.drop_untrainable

    def untrained_fate(self) -> str:
        """What becomes of a row with nothing to train on, in a summary's words."""
        return (
            "dropped" if self.drop_untrainable else "kept with nothing trained on (drop_untrainable is off)"
        )

    def untrained_action(self) -> str:
        """What is done to a row with nothing to train on, in a warning's words ("the check will ...")."""
        return "drop" if self.drop_untrainable else "leave untrained"


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def thinking_ranges(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """Character ranges of ``text[start:end]`` (an assistant message's content) that are thinking:
    each ``<think>`` through its ``</think>``, tags included; a ``</think>`` with no ``<think>`` before
    it counts from the start (templates whose generation prompt opens the tag), and a ``<think>`` never
    closed runs to the end."""
    ranges = []
    pos = start
    while pos < end:
        opened = text.find(THINK_OPEN, pos, end)
        closed = text.find(THINK_CLOSE, pos, end)
        if closed != -1 and (opened == -1 or closed < opened):  # closes what the header opened
            ranges.append((pos, closed + len(THINK_CLOSE)))
            pos = closed + len(THINK_CLOSE)
        elif opened != -1:
            closed = text.find(THINK_CLOSE, opened + len(THINK_OPEN), end)
            stop = end if closed == -1 else closed + len(THINK_CLOSE)
            ranges.append((opened, stop))
            pos = stop
        else:
            break
    return ranges


#: Roles whose messages are tool results, in the reference's templates and in common data.
TOOL_ROLES = ("tool", "environment", "ipython")


@dataclass(frozen=True)
class MaskPolicy:
    """Opt-in text taken out of the mask, beyond the reference (default: nothing, byte-compatible), by the
    mixer's names."""

    mask_thinking: bool = False  # assistant <think> ... </think>
    mask_tool_calls: bool = False  # what the template renders for an assistant message's tool calls
    mask_tool_outputs: bool = False  # tool results (roles tool, environment, ipython): for mask: all

    def __bool__(self) -> bool:
        return self.mask_thinking or self.mask_tool_calls or self.mask_tool_outputs

    def pieces(self, message: dict) -> list[str]:
        """The texts of ``message`` that are not to be trained on (tool calls aside: see ``calls``)."""
        role, content = message.get("role"), message.get("content")
        pieces = []
        if role == "assistant" and self.mask_thinking and isinstance(content, str):
            pieces += [content[s:e].strip() for s, e in thinking_ranges(content, 0, len(content))]
        elif role in TOOL_ROLES and self.mask_tool_outputs and isinstance(content, str):
            pieces.append(content.strip())
        return [p for p in pieces if p]

    def calls(self, message: dict) -> bool:
        """Whether ``message`` has tool calls this policy takes out."""
        return (
            self.mask_tool_calls
            and message.get("role") == "assistant"
            and any(message.get(f) for f in CALL_FIELDS)
        )


#: The fields that hold an assistant message's tool calls: the reference's templates render
#: ``function_calls`` (text); chat templates of tool-using models render ``tool_calls`` (a list).
CALL_FIELDS = ("function_calls", "tool_calls")


def apply_policy(
    policy: MaskPolicy,
    renderer: ChatRenderer,
    conversations: Sequence[Conversation],
    rendered: list[str],
    encs: list[Encoded],
    results: list[TokenizedRow],
) -> None:
    """No trained token overlaps a policy's text.

    Each message's text is looked for only where the render shows that message (between the renders of
    the conversation up to it and through it), so a tool result that an answer repeats is not taken out
    of the answer; where a template re-renders earlier turns (the prefixes are not prefixes of the
    whole), from the previous piece found on. A message's tool calls are what the template renders
    for them, tags included: where the whole render differs from the render without its call fields
    (a template that ignores the fields renders none)."""
    for conv, text, enc, row in zip(conversations, rendered, encs, results, strict=True):
        if row.status != RowStatus.KEPT or not row.mask.any():
            continue
        wanted = [(k, policy.pieces(m), policy.calls(m)) for k, m in enumerate(conv.messages)]
        if not any(pieces or calls for _, pieces, calls in wanted):
            continue
        out: list[tuple[int, int]] = []
        cursor = 0
        for k, pieces, calls in wanted:
            if calls:
                found = _calls_range(renderer, conv, text, k)
                if found is not None:
                    out.append(found)
                elif (
                    isinstance(text_calls := conv.messages[k].get("function_calls"), str)
                    and text_calls.strip()
                ):
                    pieces = [*pieces, text_calls.strip()]  # the template re-renders turns: find the text
            if not pieces:
                continue
            lo, hi = _message_range(renderer, conv, text, k)
            if lo is None:
                lo, hi = cursor, len(text)
            for piece in pieces:
                at = text.find(piece, lo, hi)
                if at == -1:
                    continue  # the template does not show it (e.g. earlier thinking removed)
                out.append((at, at + len(piece)))
                cursor = lo = at + len(piece)
        if out:
            offsets = enc.offsets(row.ids.shape[0])
            starts, ends = offsets[:, 0], offsets[:, 1]
            for s, e in out:
                row.mask[(starts < e) & (s < ends)] = 0


def _calls_range(renderer: ChatRenderer, conv: Conversation, text: str, k: int) -> tuple[int, int] | None:
    """The characters the template renders for message ``k``'s tool calls: where the whole render
    differs from the render of the same conversation without that message's call fields."""
    without = {key: value for key, value in conv.messages[k].items() if key not in CALL_FIELDS}
    try:
        plain = renderer.render([*conv.messages[:k], without, *conv.messages[k + 1 :]], conv.tools, False)
    except Exception:
        return None
    start = common_prefix_length(text, plain)
    same_end = common_prefix_length(text[start:][::-1], plain[start:][::-1])
    end = len(text) - same_end
    # the same insertion can often be placed a few characters earlier ("x.<" + "tool_call>...<" vs
    # "x." + "<tool_call>..."): take the earliest, where the tags the template adds begin
    while start > 0 and end > start and text[start - 1] == text[end - 1]:
        start, end = start - 1, end - 1
    return (start, end) if end > start else None


def _message_range(renderer: ChatRenderer, conv: Conversation, text: str, k: int) -> tuple[int | None, int]:
    """Where message ``k`` lies in the whole render, when its prefixes render as prefixes of it."""
    try:
        before = renderer.render(conv.messages[:k], conv.tools, False) if k else ""
        through = renderer.render(conv.messages[: k + 1], conv.tools, False)
    except Exception:
        return None, len(text)
    if text.startswith(before) and text.startswith(through) and len(before) <= len(through):
        return len(before), len(through)
    return None, len(text)
