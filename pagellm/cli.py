"""The `pagellm` command line: `generate`, `serve`, `chat`, `plan` and `bench serve`.

Engine flags are generated from the EngineArgs dataclass, so `--max-model-len` here and
`LLM(max_model_len=...)` are the same setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
import typing

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "Explain in one sentence what a KV cache is.",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
    "The best way to learn programming is",
    "Translate to French: Good morning, how are you?",
    "What is 12 times 12?",
]


_SHORT_FLAGS = {"tensor_parallel_size": ["-tp"]}  # vLLM's


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    from pagellm.engine.arg_utils import EngineArgs

    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine arguments (the same as LLM(...) keyword arguments)")
    for f in dataclasses.fields(EngineArgs):
        if f.name in ("model", "trace"):  # trace: --trace FILE (generate), --trace-dir (serve)
            continue
        if f.name == "structured_outputs_config":
            _add_structured_outputs_flags(group)
            continue
        if f.name == "speculative_config":  # vLLM's: a JSON object
            group.add_argument(
                "--speculative-config", default=None, metavar="JSON",
                help='speculative decoding, e.g. \'{"method": "ngram"}\' (vLLM\'s keys)',
            )  # fmt: skip
            continue
        if f.name == "hf_overrides":  # vLLM's: a JSON object
            group.add_argument(
                "--hf-overrides", default=None, metavar="JSON",
                help="HF config attributes replaced, e.g. '{\"architectures\": [...]}'",
            )  # fmt: skip
            continue
        flags = ["--" + f.name.replace("_", "-"), *_SHORT_FLAGS.get(f.name, [])]
        hint = hints[f.name]
        if bool in (hint, _scalar_type(hint)):  # bool, or bool | None (None: automatic)
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            group.add_argument(*flags, type=_flag_type(hint), default=f.default)


def _scalar_type(hint: typing.Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _flag_type(hint: typing.Any) -> typing.Callable[[str], typing.Any]:
    """A flag's parser: its type, or for `int | str` (--max-model-len 4096 | auto) an int
    where the text is one."""
    args = set(typing.get_args(hint))
    return _int_or_str if {int, str} <= args else _scalar_type(hint)


def _int_or_str(text: str) -> int | str:
    try:
        return int(text)
    except ValueError:
        return text


def _add_structured_outputs_flags(group: argparse._ArgumentGroup) -> None:
    """vLLM's dotted flags, one per limit: --structured-outputs-config.max-json-depth N."""
    from pagellm.config import StructuredOutputsConfig

    hints = typing.get_type_hints(StructuredOutputsConfig)
    for f in dataclasses.fields(StructuredOutputsConfig):
        flag = "--structured-outputs-config." + f.name.replace("_", "-")
        group.add_argument(
            flag, dest=_SO_PREFIX + f.name, type=hints[f.name], default=f.default,
            metavar="N", help=f"{f.metadata['help']} (default {f.default})",
        )  # fmt: skip


_SO_PREFIX = "structured_outputs_config."


def engine_args_from(ns: argparse.Namespace):
    from pagellm.engine.arg_utils import EngineArgs

    fields = dataclasses.fields(EngineArgs)
    args = {f.name: getattr(ns, f.name, f.default) for f in fields}
    limits = {k[len(_SO_PREFIX) :]: v for k, v in vars(ns).items() if k.startswith(_SO_PREFIX)}
    args["structured_outputs_config"] = limits or None
    return EngineArgs(**args)


# SamplingParams fields that are flags: name -> (dest, argparse keywords); --seed is the engine's
def _sampling_flags() -> dict[str, tuple[str, dict]]:
    from pagellm.sampling_params import SamplingParams

    hints = typing.get_type_hints(SamplingParams)
    flags = {}
    for name in SamplingParams.__struct_fields__:
        kwargs = _flag_kwargs(hints[name])
        if kwargs is not None:
            flags[name] = ("sampling_seed" if name == "seed" else name, kwargs)
    return flags


def _flag_kwargs(hint: typing.Any) -> dict | None:
    """argparse keywords for a field's type: a scalar, a bool, or a list (a repeatable flag);
    None for what a flag cannot spell (dicts, enums, nested structs)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if args == [bool]:
        return {"action": argparse.BooleanOptionalAction}
    if len(args) == 1 and args[0] in (int, float, str):
        return {"type": args[0]}
    lists = [typing.get_args(a)[0] for a in args if typing.get_origin(a) is list]
    if lists and lists[0] in (int, str):
        return {"action": "append", "type": lists[0], "help": "repeatable"}
    return None


def add_sampling_args(parser: argparse.ArgumentParser, defaults: dict[str, typing.Any]) -> None:
    """One flag per SamplingParams field a flag can spell (`defaults` overrides its default)."""
    from pagellm.sampling_params import SamplingParams

    group = parser.add_argument_group("sampling arguments (the SamplingParams fields)")
    base = SamplingParams()
    for name, (dest, kwargs) in _sampling_flags().items():
        default = None if kwargs.get("action") == "append" else getattr(base, name)
        default = defaults.get(name, default)
        flag = "--" + dest.replace("_", "-")
        group.add_argument(flag, dest=dest, default=default, **kwargs)


def sampling_params_from(ns: argparse.Namespace):
    from pagellm.sampling_params import SamplingParams

    flags = _sampling_flags()
    return SamplingParams(**{name: getattr(ns, dest) for name, (dest, _) in flags.items()})


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts (default: built-in ones)")
    p.add_argument("prompts", nargs="*", help="prompts; none: a few built-in prompts")
    p.add_argument("--model", default=None, help="HF folder, .gguf file or shipped config name")
    add_sampling_args(p, {"max_tokens": 64, "temperature": 0.0})
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--trace", default=None, metavar="FILE", help=_TRACE_HELP)
    add_engine_args(p)
    p.set_defaults(func=run_generate)


def run_generate(ns: argparse.Namespace) -> int:
    from pagellm.entrypoints.llm import LLM

    params = sampling_params_from(ns)  # bad values fail here, before the engine starts
    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    prompts = ns.prompts or DEFAULT_PROMPTS
    start = time.perf_counter()
    if ns.chat or not ns.prompts:  # the built-in prompts are questions for the chat model
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    _print_outputs(outputs, prompts, elapsed)
    llm.shutdown()
    return 0


def _print_outputs(outputs: list, prompts: list[str], elapsed: float) -> None:
    for prompt, out in zip(prompts, outputs):
        print(f"\n--- {prompt!r}\n{out.outputs[0].text}")
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    n_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print(
        f"\n{len(outputs)} requests, {n_in} prompt + {n_out} generated tokens in {elapsed:.2f} s: "
        f"{n_out / elapsed:.1f} output tok/s"
    )


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=_MODEL_HELP)
    p.add_argument("--model", default=None, help="the same as MODEL")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--uvicorn-log-level", default="info", choices=_LOG_LEVELS)
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": parse tool calls with --tool-call-parser')  # fmt: skip
    from pagellm.entrypoints.openai.tool_parsers import TOOL_PARSERS

    # every server parser (gpt-oss's "openai" included): the list the server itself checks
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS))
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file")
    _server_options(p)
    p.add_argument("--trace-dir", default=None, metavar="DIR", help=_TRACE_DIR_HELP)
    add_engine_args(p)
    p.set_defaults(func=run_serve)


def _server_options(p: argparse.ArgumentParser) -> None:
    """One flag per ServerOptions field."""
    from pagellm.entrypoints.openai.server_options import ServerOptions

    hints = typing.get_type_hints(ServerOptions)
    for f in dataclasses.fields(ServerOptions):
        flag, kind = "--" + f.name.replace("_", "-"), _scalar_type(hints[f.name])
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                           help=f.metadata["help"])  # fmt: skip
        else:
            parse = f.metadata["parse"]
            p.add_argument(flag, type=_arg_type(parse) if parse else kind, default=f.default,
                           help=f.metadata["help"], choices=f.metadata["choices"],
                           nargs=f.metadata["nargs"])  # fmt: skip


def _arg_type(parse: typing.Callable[[str], typing.Any]) -> typing.Callable[[str], typing.Any]:
    """A field's own parser as an argparse type: its ValueError's text is the usage error."""

    def arg_type(text: str) -> typing.Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return arg_type


_TRACE_HELP = "write a request-journey trace (Chrome trace JSON, ui.perfetto.dev) to FILE"
_TRACE_DIR_HELP = "write a request-journey trace (journey-PID.json) in DIR at shutdown"
_MODEL_HELP = "HF folder, .gguf file or shipped config name; none: the embedded SmolLM2"
_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def run_serve(ns: argparse.Namespace) -> int:
    try:
        from pagellm.entrypoints.openai.api_server import run_server
    except ImportError as e:
        print(f"pagellm serve needs the server extra (pip install 'pagellm[server]'): {e}")
        return 2
    from pagellm.entrypoints.openai.server_options import ServerOptions

    ns.model = ns.model_tag or ns.model
    fields = dataclasses.fields(ServerOptions)
    options = ServerOptions(**{f.name: getattr(ns, f.name) for f in fields})
    if ns.trace_dir is not None:
        os.makedirs(ns.trace_dir, exist_ok=True)
        ns.trace = os.path.join(ns.trace_dir, f"journey-{os.getpid()}.json")
    chat_options = {
        "tool_call_parser": ns.tool_call_parser,
        "enable_auto_tool_choice": ns.enable_auto_tool_choice,
        "chat_template": ns.chat_template,
    }
    code = run_server(
        engine_args_from(ns), ns.host, ns.port, options, ns.uvicorn_log_level, ns.access_log,
        chat_options,
    )  # fmt: skip
    if code:  # the engine core died and is shut down: skip the interpreter's slow teardown
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _chat_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a model in this terminal (streaming)")
    p.add_argument("--model", default=None, help=_MODEL_HELP)
    p.add_argument("--system", default=None, help="a system message to start with")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    add_engine_args(p)
    p.set_defaults(func=run_chat)


def run_chat(ns: argparse.Namespace) -> int:
    from pagellm.entrypoints.chat_cli import run_chat as chat

    return chat(engine_args_from(ns), ns)


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="will a model fit, and with which flags? (from its config; no weights loaded)",
        description="Predict the KV cache the engine would size for MODEL with these engine "
        "flags, and how many requests of each context length it holds at once; exit status 1 "
        "when it does not fit.",
    )
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=_PLAN_MODEL_HELP)
    p.add_argument("--model", default=None, help="the same as MODEL")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GiB",
                   help="memory of one GPU (default: the local GPU's)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="the plan as JSON, for scripts")
    add_engine_args(p)
    p.set_defaults(func=run_plan)


_PLAN_MODEL_HELP = (
    "HF folder, .gguf file, shipped config name (qwen3-0.6b, llama-3.1-8b, ...) or Hub id "
    "(its config.json only); none: the embedded SmolLM2"
)


def run_plan(ns: argparse.Namespace) -> int:
    from pagellm.engine.plan_report import make_plan, render_text, to_json

    ns.model = ns.model_tag or ns.model
    plan = make_plan(engine_args_from(ns), ns.gpu_memory)
    print(to_json(plan) if ns.json else render_text(plan))
    return 0 if plan.fits else 1


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    from pagellm.benchmarks import serve

    p = sub.add_parser("bench", help="benchmarks")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    serve_parser = bench_sub.add_parser("serve", help="load-test a running server")
    serve.add_cli_args(serve_parser)
    serve_parser.set_defaults(func=serve.main)


def _trace_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="read a request-journey trace")
    trace_sub = p.add_subparsers(dest="trace_command", required=True)
    summarize = trace_sub.add_parser("summarize", help="walk one request through its boundaries")
    summarize.add_argument("file", help="a trace written by --trace / LLM(trace=...)")
    summarize.add_argument("--request-id", default=None, help="default: the first request")
    summarize.set_defaults(func=run_trace_summarize)


def run_trace_summarize(ns: argparse.Namespace) -> int:
    from pagellm.tracing import summarize

    print(summarize(ns.file, ns.request_id))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagellm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _chat_parser(sub)
    _plan_parser(sub)
    _bench_parser(sub)
    _trace_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pagellm.logger import setup_logging

    setup_logging()
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"pagellm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
