"""One example: its shared prefix P, item, target and loss spans (what every data format gives), the conversation a
text or chat record is before the chat template renders it, and the error that names a bad example's file, line and
field (every bad line of a file at once)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from packtrain.data.images import ImageRef


class DataError(ValueError):
    """An unusable example or data file; the message names the file, the line and the field."""

    def __init__(self, source: str | Path, line: int | None, field: str | None, problem: str):
        self.source, self.line, self.field, self.problem = str(source), line, field, problem
        where = f"{source}:{line}" if line else str(source)
        what = f" field '{field}':" if field else ""
        super().__init__(f"{where}:{what} {problem}")


class BadLines(DataError):
    """Several bad lines of one data file, each its own :class:`DataError` (its first problem), in line order: the
    first :attr:`SHOWN` are listed, then how many more. ``line``, ``field`` and ``problem`` are the first's."""

    SHOWN = 20

    def __init__(self, errors: list[DataError]):
        self.errors = errors
        first = errors[0]
        self.source, self.line, self.field, self.problem = first.source, first.line, first.field, first.problem
        listed = "".join(f"\n  - {e}" for e in errors[: self.SHOWN])
        more = len(errors) - self.SHOWN
        ValueError.__init__(self, f"{first.source}: {len(errors)} bad lines:{listed}"
                                  + (f"\n  ... and {more} more bad lines" if more > 0 else ""))


class LineErrors:
    """The first problem of each bad line of one data file, collected so that every bad line is reported at once
    (as config problems are). Each rank reads the same file in the same order, so each raises the same error."""

    def __init__(self):
        self.by_line: dict[int, DataError] = {}

    def add(self, error: DataError) -> None:
        self.by_line.setdefault(error.line, error)

    def __contains__(self, line: int) -> bool:
        return line in self.by_line

    @contextmanager
    def catch(self):
        """A DataError raised in the block is the bad line's (and the block's work is dropped)."""
        try:
            yield
        except DataError as e:
            self.add(e)

    def raise_any(self) -> None:
        """The one bad line's DataError as it was raised, or :class:`BadLines` for several; nothing when none."""
        errors = [self.by_line[line] for line in sorted(self.by_line)]
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise BadLines(errors)


@dataclass(frozen=True)
class Example:
    id: str
    prefix_ids: tuple[int, ...]
    item_ids: tuple[int, ...]
    target_ids: tuple[int, ...]
    source: str = ""
    line: int = 0
    images: tuple[ImageRef, ...] = ()  # images of the continuation, in order; their tokens are counted in the ids
    # The loss spans [a, b) in continuation coordinates (item + target), in order; (): the whole target. The item is
    # the tokens before the first span, so a target starts with a loss token.
    spans: tuple[tuple[int, int], ...] = ()
    turns: int = 1  # assistant turns whose tokens carry loss
    # Text and chat: the item and the target, tokenized apart as when the model generates the target, are other
    # tokens than the whole render tokenized at once (a merge across the boundary, as Qwen's "\n\n" after <think>).
    whole_differs: bool = False
    weight: float = 1.0  # the example's weight under train.objective weighted (the record's "weight")
    # A preference pair's side: the pair's id (the record's) and "chosen" or "rejected"; "" for a plain example. A
    # pair's two examples share P and the item and differ in their targets (the answers).
    pair: str = ""
    side: str = ""
    # A scored group's completion (train.objective grpo): the group's id (the record's), the completion's reward, every
    # completion's of the group (its advantage needs them all) and the sampler's log-probabilities of its target
    # tokens (None: on-policy); "" for any other example
    group: str = ""
    reward: float = 0.0
    logprobs: tuple[float, ...] | None = None
    group_rewards: tuple[float, ...] = ()

    @property
    def continuation_ids(self) -> tuple[int, ...]:
        return self.item_ids + self.target_ids

    @property
    def len_continuation(self) -> int:
        return len(self.item_ids) + len(self.target_ids)

    @property
    def loss_spans(self) -> tuple[tuple[int, int], ...]:
        return self.spans or ((len(self.item_ids), self.len_continuation),)

    @property
    def n_targets(self) -> int:
        """Tokens that carry loss."""
        return sum(b - a for a, b in self.loss_spans)


@dataclass
class Conversation:
    """A text or chat record before tokenization, with the names its pieces have in the file (for errors)."""

    id: str
    line: int
    messages: list[dict]
    system_field: str
    target_field: str
    images: list[tuple[str, str]] = field(default_factory=list)  # (resolved path, field) in order of appearance
    tools: list[dict] | None = None
    images_through: list[int] = field(default_factory=list)  # images in messages[: i + 1], per message i
    weight: float = 1.0  # what its examples carry (Example.weight, .pair, .side, .group, .reward, .logprobs)
    pair: str = ""
    side: str = ""
    group: str = ""  # a scored group's completion: the group's id, its reward and the sampler's log-probabilities
    reward: float = 0.0
    logprobs: tuple[float, ...] | None = None
    group_rewards: tuple[float, ...] = ()
    messages_field: str = "messages"  # what the file calls the messages (TRL's pairs: prompt, or chosen)

    def message_field(self, k: int) -> str:
        """Message ``k``'s field as the file names it (a text record's are system, item and its target)."""
        if k == 0:
            return self.system_field
        if k == len(self.messages) - 1:
            return self.target_field
        return "item" if self.system_field == "system" else f"{self.messages_field}[{k}]"
