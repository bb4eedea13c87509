"""Incremental detokenization and stop-string matching for one request."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Byte-level BPE can split one character over several tokens, so text is released only once
    it no longer ends in a replacement character. Text that might be the start of a stop string
    is held back until it is known not to be, so a stream never shows part of a stop string.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # everything decoded so far (stop string cut off once matched)
        self.emitted = 0  # characters of ``text`` already returned
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, output_ids: list[int]) -> bool:
        """Decode what ``output_ids`` (all output so far) adds. Returns True if a stop string
        matched; ``text`` then ends just before it."""
        prefix = self._decode(output_ids[self._prefix_offset : self._read_offset])
        full = self._decode(output_ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        search_from = max(0, len(self.text) - self.holdback)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(output_ids)
        hits = [at for at in (self.text.find(s, search_from) for s in self.stop) if at != -1]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def flush(self, output_ids: list[int]) -> None:
        """At the end, keep whatever bytes are still pending, even an incomplete character."""
        prefix = self._decode(output_ids[self._prefix_offset : self._read_offset])
        full = self._decode(output_ids[self._prefix_offset :])
        self.text += full[len(prefix) :]
        self._prefix_offset = self._read_offset = len(output_ids)

    def delta(self, finished: bool) -> str:
        """New text to release; while unfinished, keep back what could begin a stop string."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
