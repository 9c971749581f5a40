"""`POST /tokenize` and `POST /detokenize` (vLLM's endpoints): the server's tokenizer and chat
template, without generating."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from pagellm.engine.input_processor import check_in_vocab
from pagellm.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat


class OpenAIServingTokenization(OpenAIServingChat):
    """Shares the chat server's tokenizer, model names and template rendering."""

    async def tokenize(self, request: TokenizeRequest, raw_request: Request) -> JSONResponse:
        self.model_name(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise ValueError("send either prompt or messages")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        if request.messages is not None:
            # the template adds its own special tokens
            _, tokens = await self.render_and_encode(request, raw_request, False)
        else:
            tokens = await self.off_loop(self.encode, request.prompt, request.add_special_tokens)
        return JSONResponse(
            {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}
        )

    async def detokenize(self, request: DetokenizeRequest) -> JSONResponse:
        self.model_name(request.model)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        check_in_vocab(request.tokens, self.engine.config.model_config.vocab_size)
        return JSONResponse({"prompt": await self.off_loop(self.tokenizer.decode, request.tokens)})
