"""IncrementalDetokenizer: new token ids -> new text, one request at a time.

Fast tokenizers use the tokenizers library's DecodeStream, which holds back bytes of a
character split across tokens until the character is complete. Stop strings are checked
here, on text, since they can span tokens.
"""

from __future__ import annotations

from typing import Any

from pagellm.sampling_params import SamplingParams

_PROMPT_CONTEXT = 4  # prompt tokens that prime the stream, so the first word decodes right


class IncrementalDetokenizer:
    __slots__ = ("_stream", "_tokenizer", "_stop", "_hold", "_include_stop", "_min_tokens", "text")

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer._tokenizer  # the Rust tokenizer behind a fast HF tokenizer
        self._stream = DecodeStream(
            ids=prompt_token_ids[-_PROMPT_CONTEXT:], skip_special_tokens=params.skip_special_tokens
        )
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # characters held back while they could still become a stop string
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""

    def update(self, new_token_ids: list[int], num_output_tokens: int) -> str | None:
        """Appends the new tokens' text; returns the stop string that matched, if any."""
        start = len(self.text)
        for token_id in new_token_ids:
            piece = self._stream.step(self._tokenizer, token_id)
            if piece:
                self.text += piece
        if not self._stop or num_output_tokens < self._min_tokens:
            return None
        return self._check_stop(max(0, start - self._hold))

    def _check_stop(self, search_from: int) -> str | None:
        for stop in self._stop:
            at = self.text.find(stop, search_from)
            if at != -1:
                self.text = self.text[: at + len(stop) if self._include_stop else at]
                return stop
        return None

    def output_text(self, finished: bool) -> str:
        """Text that is safe to show: all of it once finished, else minus the held-back tail."""
        if finished or not self._hold:
            return self.text
        return self.text[: max(0, len(self.text) - self._hold)]
