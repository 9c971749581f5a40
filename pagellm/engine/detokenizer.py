"""IncrementalDetokenizer: new token ids -> new text, one request at a time.

Fast tokenizers use the tokenizers library's DecodeStream, which holds back bytes of a
character split across tokens until the character is complete. Stop strings are checked
here, on text, since they can span tokens.

Stop strings, exactly:
- a stop string counts only where it ends after the text of the first `min_tokens` tokens
  (those tokens cannot stop the request, as EOS and stop token ids cannot);
- of the stop strings found in one update, the one that ends first wins (ties: the longest),
  which is where a check after every character would have stopped;
- until the request finishes, the last `len(longest stop string) - 1` characters are held
  back from `output_text()`: they may still become a stop string, and a streaming client
  must never receive a part of one.
"""

from __future__ import annotations

from typing import Any

from pagellm.sampling_params import SamplingParams

_PROMPT_CONTEXT = 4  # prompt tokens that prime the stream, so the first word decodes right
_MAX_DANGLING = 8  # prompt tokens at the end that may be dropped from the context (see below)


class IncrementalDetokenizer:
    __slots__ = (
        "_stream",
        "_tokenizer",
        "_stop",
        "_hold",
        "_include_stop",
        "_min_tokens",
        "_num_tokens",
        "_protected",
        "text",
    )

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer._tokenizer  # the Rust tokenizer behind a fast HF tokenizer
        skip = params.skip_special_tokens
        self._stream = DecodeStream(
            ids=_context(self._tokenizer, prompt_token_ids, skip), skip_special_tokens=skip
        )
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_tokens = 0  # output tokens decoded so far
        # length of the text of the first min_tokens tokens, once they are decoded
        self._protected: int | None = 0 if params.min_tokens == 0 else None
        # characters held back while they could still become a stop string
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""

    def update(self, new_token_ids: list[int]) -> str | None:
        """Appends the new tokens' text; returns the stop string that matched, if any (the
        text then ends before it, or after it with include_stop_str_in_output)."""
        start = len(self.text)
        pieces = []
        for token_id in new_token_ids:
            piece = self._stream.step(self._tokenizer, token_id)
            if piece:
                pieces.append(piece)
            self._num_tokens += 1
            if self._num_tokens == self._min_tokens:
                self._protected = start + sum(map(len, pieces))
        self.text += "".join(pieces)
        if not self._stop or self._protected is None:
            return None
        return self._check_stop(max(start, self._protected))

    def _check_stop(self, checked: int) -> str | None:
        """The stop string that ends first after text[:checked] (which holds none)."""
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stop:
            at = self.text.find(stop, max(0, checked - len(stop) + 1))
            if at != -1 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        if best is None:
            return None
        end, at, stop = best
        self.text = self.text[: end if self._include_stop else at]
        return stop

    def output_text(self, finished: bool) -> str:
        """Text that is safe to show: all of it once finished, else minus the held-back tail."""
        if finished or not self._hold:
            return self.text
        return self.text[: max(0, len(self.text) - self._hold)]


def _context(tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> list[int]:
    """The prompt tokens that prime the stream: the last _PROMPT_CONTEXT, short of any at the
    end whose bytes are no complete character (a prompt of byte tokens, cut mid-character or
    invalid UTF-8). DecodeStream holds such bytes back and would put them, as U+FFFD, at the
    start of the output's text; the output's text is its own tokens' (as HF's `decode` of the
    output ids)."""
    for end in range(len(prompt_token_ids), len(prompt_token_ids) - _MAX_DANGLING - 1, -1):
        context = prompt_token_ids[max(0, end - _PROMPT_CONTEXT) : max(0, end)]
        text = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
        if not text.endswith("\ufffd"):
            return context
    return []
