"""A step's sampled tokens into a request: appended up to the first that ends it (the stop
checks: grammar, length, EOS, stop token ids, after min_tokens), and the request's
EngineCoreOutput of the step (logprobs; prompt logprobs, gathered over its prefill chunks,
with its first token). A request that
fails alone ends with `error_output`.

Speculative decoding appends several tokens a step here: every check runs over the accepted
tokens in order, and the first that stops the request drops the rest.
"""

from __future__ import annotations

from pagellm.core.request import Request, RequestStatus
from pagellm.core.sched_output import ModelRunnerOutput
from pagellm.protocol import EngineCoreOutput, FinishReason


def error_output(request_id: str, error: Exception) -> EngineCoreOutput:
    """The last output of a request that failed on its own: no tokens, aborted, the error (a
    ValueError's message is the request's fault in our words; others carry their type)."""
    message = str(error) if type(error) is ValueError else f"{type(error).__name__}: {error}"
    return EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT, error=message)


def append_tokens(request: Request, token_ids: list[int], max_request_len: int) -> list[int]:
    """Append sampled tokens up to the first that finishes the request; return those."""
    for n, token_id in enumerate(token_ids, 1):
        request.append_output_token(token_id)
        if check_stop(request, token_id, max_request_len):
            return token_ids[:n]
    return token_ids


def check_stop(request: Request, token_id: int, max_request_len: int) -> bool:
    """Set a finished status if `token_id`, just appended, ends the request."""
    params = request.sampling_params
    max_tokens = params.max_tokens
    grammar = request.structured_output
    if grammar is not None and grammar.accept(token_id):  # the grammar is complete
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if request.num_tokens >= max_request_len or (
        max_tokens is not None and request.num_output_tokens >= max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    if request.num_output_tokens < params.min_tokens:
        return False
    if token_id in request.eos_token_ids and not params.ignore_eos:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if token_id in (params.stop_token_ids or ()):
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = token_id
        return True
    return False


def sampled_output(
    request: Request, new_token_ids: list[int], mro: ModelRunnerOutput, i: int
) -> EngineCoreOutput:
    """The request's output of a step: `new_token_ids` (appended), row `i` of the runner's."""
    first_output = request.num_output_tokens == len(new_token_ids)
    output = EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        finish_reason=request.status.finish_reason,
        stop_reason=request.stop_reason,
        num_cached_tokens=max(request.num_cached_tokens, 0) if first_output else 0,
    )
    if first_output and request.prompt_logprobs is not None:
        (
            output.prompt_logprobs,
            output.prompt_logprob_ids,
            output.prompt_logprob_ranks,
        ) = request.prompt_logprobs
    num_logprobs = request.sampling_params.logprobs
    if num_logprobs is not None and mro.logprobs is not None and mro.logprobs[i]:
        # the step computed the largest k any request asked for: keep this one's 1 + k, for
        # the tokens appended (a stop among accepted drafts drops those after it)
        n, k = len(new_token_ids), 1 + num_logprobs
        output.new_logprobs = [row[:k] for row in mro.logprobs[i][:n]]
        output.new_top_logprob_ids = [row[:k] for row in mro.logprob_token_ids[i][:n]]
        output.new_logprob_ranks = mro.logprob_ranks[i][:n]
    return output


def gather_prompt_logprobs(requests: dict[str, Request], chunks: dict) -> None:
    """Add each prefill chunk's prompt logprob rows at its positions (a chunk recomputed after
    a preemption replaces what it covers)."""
    for req_id, (start, *rows) in chunks.items():
        request = requests.get(req_id)
        if request is None or request.prompt_logprobs is None:
            continue
        for gathered, new in zip(request.prompt_logprobs, rows):  # values, ids, ranks
            del gathered[start:]
            gathered += new
