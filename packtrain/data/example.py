"""One example: its shared prefix P, item, target and loss spans (what every data format gives), the conversation a
text or chat record is before the chat template renders it, and the error that names a bad example's file, line and
field."""

from __future__ import annotations

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
    weight: float = 1.0  # what its examples carry (Example.weight, .pair, .side)
    pair: str = ""
    side: str = ""
