"""The `kvref` command: run and chat with a model, inspect a file, trace what the cache saves,
and size what it costs."""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

from .. import __version__
from ..cache import bytes_per_position
from ..cache.capabilities import k_shift_problem
from ..conformance.command import add_conformance, add_fixtures
from ..errors import CacheError, ConfigError, ContextOverflowError, GenerationError, KVRefError, TokenizerError
from ..executor import describe
from ..generation.config import DEFAULT_PENALTY_LAST_N, GenerationConfig, check_stop_strings
from ..generation.generate import generate, prefill_in_chunks
from ..generation.sampling import check_penalties, check_sampling
from ..generation.speculative import SpeculationStats
from ..generation.stream import TextStream
from ..limits import read_json_file
from ..native import MAX_THREADS
from ..text.templates import BUILTIN_TEMPLATES
from .bench import add_bench
from .machine import blas_threads
from .common import (Progress, activations, add_activations_argument, add_model_arguments, available_memory, count,
                     count_in, human_bytes, line_editing)
from .export import add_export
from .info import add_inspect, add_memory, add_trace
from .models import add_models
from .perplexity import add_perplexity


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = lambda message, *_: notice(args, str(message))
            return args.run(args)
    except KVRefError as error:
        print(f"kvref {args.command}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nkvref {args.command}: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, what a shell reports for a process Ctrl-C ended
    except BrokenPipeError:
        # the reader went away (`kvref inspect | head`): stop quietly, as a process SIGPIPE ended would;
        # stdout goes to /dev/null so the interpreter's last flush finds nowhere to fail
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE


def parser() -> argparse.ArgumentParser:
    """The `kvref` command line: every subcommand and its flags."""
    parser = argparse.ArgumentParser(prog="kvref", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvref {__version__}", help="print the version")
    commands = parser.add_subparsers(dest="command", required=True,
                                     help="what to do (kvref COMMAND --help says more)")
    add_run(commands)
    add_chat(commands)
    add_inspect(commands)
    add_trace(commands)
    add_memory(commands)
    add_bench(commands)
    add_perplexity(commands)
    add_serve(commands)
    add_conformance(commands)
    add_fixtures(commands)
    add_export(commands)
    add_models(commands)
    return parser


def notice(args, text: str) -> None:
    """A one-line message about what kvref did (a notice, a warning) on stderr; --quiet drops it."""
    if not getattr(args, "quiet", False):
        print(f"kvref {args.command}: {text}", file=sys.stderr, flush=True)


GENERATION_HELP = """Decoding is greedy, hence deterministic, unless --temperature is given (or the model file
recommends sampling: generation_config.json's do_sample, GGUF general.sampling.temp); --top-k,
--top-p and --min-p apply only when sampling. Generation stops at the model's end ids (EOS, end of
turn: --ignore-eos goes on) and at the first --stop string, whose text is never printed. Penalties
count the last --repeat-last-n tokens (prompt included): repeat as transformers and llama.cpp
(logit > 0 divided by it, else multiplied), frequency and presence as OpenAI and llama.cpp
(logit -= count x frequency + presence)."""


def add_sampling_arguments(p):
    g = p.add_argument_group("generation", GENERATION_HELP)
    g.add_argument("--max-tokens", type=count, default=None, help="tokens to generate at most (default 128)")
    g.add_argument("--temperature", type=_checked(float, lambda v: check_sampling(temperature=v)),
                   help="> 0 samples; 0 = greedy (default, unless the model file recommends sampling)")
    g.add_argument("--top-k", type=_checked(int, lambda v: check_sampling(top_k=v)),
                   help="sample among the K most likely tokens")
    g.add_argument("--top-p", type=_checked(float, lambda v: check_sampling(top_p=v)),
                   help="sample among the most likely tokens whose probabilities reach P")
    g.add_argument("--min-p", type=_checked(float, lambda v: check_sampling(min_p=v)),
                   help="sample among tokens at least P x as likely as the most likely one")
    g.add_argument("--seed", type=count, default=None, help="the sampler's seed (no effect when greedy)")
    g.add_argument("--repeat-penalty", type=_checked(float, lambda v: check_penalties(repetition_penalty=v)),
                   help="> 0; 1 = off (default)")
    g.add_argument("--frequency-penalty", type=_checked(float, lambda v: check_penalties(frequency_penalty=v)),
                   help="subtracted once per occurrence (default 0)")
    g.add_argument("--presence-penalty", type=_checked(float, lambda v: check_penalties(presence_penalty=v)),
                   help="subtracted once from every token that occurred (default 0)")
    g.add_argument("--repeat-last-n", type=_checked(int, _check_last_n),
                   help=f"previous tokens the penalties count (default {DEFAULT_PENALTY_LAST_N}; -1 = all, 0 = none)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   type=_checked(str, lambda v: check_stop_strings([v])),
                   help="stop before this text (repeatable; \\n in TEXT is a newline)")
    g.add_argument("--ignore-eos", action="store_true", default=None,
                   help="go on past the model's end-of-sequence and end-of-turn ids")


def _checked(parse, check):
    """argparse type: `parse` the text, then `check` the value; a KVRefError becomes the flag's error."""
    def convert(text):
        value = parse(text)
        try:
            check(value)
        except KVRefError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return value

    convert.__name__ = parse.__name__  # argparse names the type in "invalid float value"
    return convert


def _check_seconds(value):
    if not 0 <= value < float("inf"):
        raise ConfigError(f"{value} is not a number of seconds >= 0")


def _check_last_n(value):
    check_penalties(penalty_last_n=None if value == -1 else value)


# flag -> GenerationConfig field (and how to read the flag's value)
GENERATION_FLAGS = {"max_tokens": "max_new_tokens", "temperature": "temperature", "top_k": "top_k",
                    "top_p": "top_p", "min_p": "min_p", "seed": "seed", "repeat_penalty": "repetition_penalty",
                    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
                    "repeat_last_n": "penalty_last_n", "stop": "stop", "ignore_eos": "ignore_eos"}


def generation_config(args, model) -> GenerationConfig:
    """The model's generation defaults with the flags given on the command line in their place."""
    settings = {field: getattr(args, flag) for flag, field in GENERATION_FLAGS.items() if getattr(args, flag) is not None}
    if settings.get("penalty_last_n") == -1:
        settings["penalty_last_n"] = None
    if "stop" in settings:
        settings["stop"] = [text.replace("\\n", "\n") for text in settings["stop"]]
    config = model.generation_config.updated(**settings)
    if args.seed is not None and config.greedy:
        print(f"kvref {args.command}: --seed has no effect: decoding is greedy (give --temperature to sample)",
              file=sys.stderr)
    return config


def load_model(args):
    """The model of -m/--backend/--threads, with a progress line on a terminal (not with --quiet)."""
    from ..loader import load

    progress = Progress(enabled=sys.stderr.isatty() and not getattr(args, "quiet", False),
                        label=f"kvref {args.command}")
    threads = getattr(args, "threads", None)
    model = load(args.model, backend=args.backend, threads=threads, activations=activations(args),
                 progress=lambda done, total: progress(f"loading weights {done}/{total}"))
    progress.done()
    if model.backend == "numpy" and threads is not None and blas_threads(threads) is None:
        notice(args, "--threads cannot set NumPy's BLAS threads here; set OPENBLAS_NUM_THREADS before starting")
    return model


def load_text_model(args, chat=False):
    """load_model for the commands that read and write text: the model must have a tokenizer. Its chat
    template is its own, else a built-in the loader detected, or --chat-template FILE or NAME; a chat
    says which and why."""
    model = load_model(args)
    if model.tokenizer is None:
        raise TokenizerError(f"{args.model} loaded without a tokenizer (a Hugging Face directory needs its "
                             "tokenizer.json), and this command needs one to read text")
    if args.chat_template is not None:
        model.text.use_chat_template(args.chat_template)
    if chat:
        notice(args, f"chat template: {model.text.chat_template_note}")
    return model


def add_chat_template_argument(p):
    p.add_argument("--chat-template", metavar="FILE|NAME", default=None,
                   help=f"a Jinja chat template file, or a built-in by name ({', '.join(BUILTIN_TEMPLATES)}), "
                        "instead of the model's own; a file that has none gets the built-in its vocabulary "
                        "or architecture names")


KV_DTYPES = ("float16", "bfloat16", "float32", "int8", "kivi4")
OVERFLOW = ("error", "truncate", "shift")


def add_runtime_arguments(p, chat=False):
    """The knobs of the commands that run a model on text: threads, the cache, context overflow, output."""
    p.add_argument("--threads", type=count_in(1, MAX_THREADS), default=None,
                   help="threads of the native pool, or NumPy's BLAS threads on the numpy backend "
                        "(default: KVREF_THREADS, else every usable core)")
    p.add_argument("--kv-dtype", default="float16", choices=KV_DTYPES,
                   help="element type of the cached K/V (default float16, as llama.cpp)")
    p.add_argument("-c", "--ctx-size", type=count_in(1), default=None,
                   help="positions the cache holds (default: the model's context length, lowered to what "
                        "fits in available memory, with a notice)")
    what = "the oldest turns" if chat else "the prompt's first tokens (a leading BOS stays)"
    p.add_argument("--context-overflow", default="error", choices=OVERFLOW[:2] if chat else OVERFLOW,
                   help=f"when the prompt and --max-tokens do not fit --ctx-size: error (default), truncate "
                        f"(drop {what}, with a notice) or shift (as llama.cpp: when the cache is full, drop "
                        "the older half after the first position and re-rotate the kept keys; needs float32 "
                        "K (--kv-dtype float32) because kvref never rounds stored keys twice, and is refused "
                        "by a hybrid cache such as gemma3-270m's)" if not chat else
                        f"when the conversation and --max-tokens do not fit --ctx-size: error (default) or "
                        f"truncate (drop {what}, with a notice); shift is run's only (a chat re-renders its "
                        "turns, which a shifted cache no longer matches)")
    output = p.add_mutually_exclusive_group()
    output.add_argument("-v", "--verbose", action="store_true",
                        help="also print the figures: prompt, prefill and decode tokens/s, cache size" +
                             (", positions reused per turn" if chat else ""))
    output.add_argument("-q", "--quiet", action="store_true",
                        help="print only the generated text (errors still go to stderr); the default adds "
                             "notices and, on a terminal, progress lines")


def new_cli_cache(model, args):
    """The cache of --ctx-size positions and --kv-dtype K/V. Without --ctx-size, the model's context
    length, lowered (with a notice) to what fits in half the available memory."""
    c = model.config
    per_position = bytes_per_position(c.n_layers, c.n_kv_heads, c.head_dim, args.kv_dtype)
    available = available_memory()
    if args.ctx_size is not None:
        if args.ctx_size > c.max_seq_len:
            raise ContextOverflowError(f"--ctx-size {args.ctx_size} exceeds the model's context length "
                                       f"{c.max_seq_len}")
        if available is not None and args.ctx_size * per_position > available:
            raise CacheError(f"--ctx-size {args.ctx_size} needs up to {human_bytes(args.ctx_size * per_position)} "
                             f"of {args.kv_dtype} K/V; {human_bytes(available)} is available")
        return model.new_cache(kv_dtype=args.kv_dtype, capacity=args.ctx_size)
    capacity = c.max_seq_len
    if available is not None and capacity * per_position > available // 2:
        capacity = max(available // 2 // per_position, 1)
        notice(args, f"the model's context of {c.max_seq_len:,} positions would take "
                     f"{human_bytes(c.max_seq_len * per_position)} of {args.kv_dtype} K/V, more than half the "
                     f"{human_bytes(available)} available; the cache holds {capacity:,} (set --ctx-size)")
    return model.new_cache(kv_dtype=args.kv_dtype, capacity=capacity)


def add_run(commands):
    p = commands.add_parser("run", help="generate text from a prompt, streamed as it is generated",
                            description="Generate text from a prompt, streamed to stdout as it is generated. "
                                        "Greedy (deterministic) unless --temperature is given.")
    add_model_arguments(p)
    add_activations_argument(p)
    add_sampling_arguments(p)
    add_runtime_arguments(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_chat_template_argument(p)
    p.add_argument("--speculate", type=count, default=0, metavar="N",
                   help="speculative decoding: draft up to N tokens per step by looking the last tokens up in "
                        "the text so far, verified in one execution (faster when the output repeats its "
                        "input, e.g. rewriting code; greedy output unchanged; default 0 = off); --verbose "
                        "prints drafted and accepted counts")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", default=None, metavar="FILE",
                       help="structured output: the output is JSON valid against the JSON schema in FILE, ended "
                            "by the model's end id (needs the structured extra: pip install 'kvref[structured]')")
    shape.add_argument("--grammar", default=None, metavar="FILE",
                       help="structured output: the output is in the language of the Lark grammar in FILE "
                            "(llguidance's dialect; needs the structured extra)")
    p.add_argument("-f", "--file", default=None, help="read the prompt from FILE ('-': standard input), less one "
                                                      "trailing newline (the last line's end)")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt ('-': read it from standard input, one "
                                                           "trailing newline dropped: echo TEXT | kvref run -)")
    p.set_defaults(run=run_run)


def read_prompt(args) -> str:
    """The prompt of `run`: the argument, or --file FILE, or standard input for '-' (either way). Text
    read from a file or a pipe loses one trailing newline (echo's, an editor's last line end), so that
    `echo TEXT | kvref run -` prompts with TEXT as `kvref run TEXT` does; more newlines are kept."""
    if (args.prompt is None) == (args.file is None):
        raise GenerationError("give the prompt either as an argument or with -f FILE ('-' reads standard input)")
    source = args.file if args.file is not None else args.prompt
    if args.file is None and source != "-":
        text = source
    elif source == "-":
        text = sys.stdin.read().removesuffix("\n")  # text mode: a \r\n line end reads as \n
    else:
        try:
            text = Path(source).read_text().removesuffix("\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise GenerationError(f"cannot read the prompt from {source}: {exc}") from None
    if not text:
        raise GenerationError("the prompt is empty")
    return text


def read_structure(args) -> dict:
    """generate's structured-output arguments from --json-schema FILE or --grammar FILE (none without them)."""
    if args.json_schema is not None:
        try:
            return {"json_schema": read_json_file(args.json_schema, "--json-schema file", GenerationError)}
        except FileNotFoundError:
            raise GenerationError(f"no --json-schema file at {args.json_schema}") from None
    if args.grammar is not None:
        try:
            return {"grammar": Path(args.grammar).read_text()}
        except (OSError, UnicodeDecodeError) as exc:
            raise GenerationError(f"cannot read the grammar from {args.grammar}: {exc}") from None
    return {}


def fit_prompt(args, model, prompt_ids, capacity, max_new_tokens) -> list:
    """The prompt ids that fit `capacity` positions with max_new_tokens after them, by --context-overflow."""
    needed = len(prompt_ids) + max(max_new_tokens - 1, 0)  # the last token selected needs no position
    if needed <= capacity:
        return prompt_ids
    if args.context_overflow == "shift" and len(prompt_ids) <= capacity:
        return prompt_ids  # generation shifts the cache when it fills
    if args.context_overflow != "truncate":
        raise ContextOverflowError(
            f"the prompt's {len(prompt_ids)} tokens and --max-tokens {max_new_tokens} need {needed} positions; "
            f"the cache holds {capacity} (--ctx-size); choose --context-overflow truncate"
            + ("" if args.context_overflow == "shift" else " or shift") + ", a larger --ctx-size or fewer --max-tokens")
    keep = 1 if prompt_ids[0] == model.tokenizer.bos_id else 0
    drop = needed - capacity
    if len(prompt_ids) - keep - drop < 1:
        raise ContextOverflowError(f"--max-tokens {max_new_tokens} leaves no room for the prompt in a cache of "
                                   f"{capacity} positions (--ctx-size)")
    notice(args, f"the prompt's first {drop} tokens were dropped to fit --ctx-size {capacity} "
                 "(--context-overflow truncate)")
    return prompt_ids[:keep] + prompt_ids[keep + drop:]


def prefill_progress(args, n_cached=0):
    """progress(done, total) for prefill_in_chunks: a line on a terminal once a prefill passes a second."""
    progress = Progress(enabled=sys.stderr.isatty() and not args.quiet, label=f"kvref {args.command}", after=1.0)
    start = time.perf_counter()

    def report(done, total):
        rate = done / (time.perf_counter() - start)
        progress(f"prefill {n_cached + done:,}/{n_cached + total:,} positions ({rate:.0f} tok/s)")

    report.done = progress.done
    return report


def run_run(args) -> int:
    text = read_prompt(args)
    structure = read_structure(args)
    model = load_text_model(args, chat=args.chat)
    tok = model.tokenizer
    if args.chat:
        prompt_ids = model.text.chat_ids([{"role": "user", "content": text}])
    else:
        prompt_ids = tok.encode(text, add_special=True)
    config = generation_config(args, model)
    cache = new_cli_cache(model, args)
    if args.context_overflow == "shift":
        check_shift(cache)
    prompt_ids = fit_prompt(args, model, prompt_ids, cache.capacity, config.max_new_tokens)
    start = time.perf_counter()
    progress = prefill_progress(args)
    rest = prefill_in_chunks(model, prompt_ids, cache, progress)
    progress.done()
    speculation = {"speculate": args.speculate, "stats": SpeculationStats()} if args.speculate else {}
    overflow = "shift" if args.context_overflow == "shift" else "error"  # truncate: fit_prompt cut the prompt
    tokens = generate(model, rest, config=config, cache=cache, overflow=overflow, **speculation,
                      **structure)
    timing = stream_text(tok, tokens, config)
    print()
    if args.verbose:
        n_prompt = len(prompt_ids)
        prefill_rate = n_prompt / (timing.first - start) if timing.first else 0.0
        print(f"[{n_prompt} prompt tokens, prefill {prefill_rate:.1f} tok/s, "
              f"decode {timing.decode_rate():.1f} tok/s over {timing.n_tokens} tokens, "
              f"cache {human_bytes(cache.nbytes)} ({cache.length} positions, {cache.dtype_name} K/V), "
              f"backend {model.backend}; executor {describe(model.executor(cache))}]", file=sys.stderr)
        if speculation:
            print(f"[{speculation['stats']}]", file=sys.stderr)
    return 0


def check_shift(cache):
    """CacheError unless --context-overflow shift can work on this cache, saying why."""
    problem = cache.capabilities.shift().reason
    if problem is not None:
        remedy = "give --kv-dtype float32, or " if problem == k_shift_problem(cache.k_dtype) else ""
        raise CacheError(f"--context-overflow shift cannot work on this {cache.layout} cache: {problem}; "
                         f"{remedy}use --context-overflow truncate or a larger --ctx-size")


class Timing:
    """Time to the first token (the prefill) and between later tokens (decode steps)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.first = self.last = None
        self.n_tokens = 0

    def tick(self):
        self.last = time.perf_counter()
        self.first = self.first or self.last
        self.n_tokens += 1

    def prefill_rate(self, n_prompt):
        return n_prompt / (self.first - self.start) if self.first else 0.0

    def decode_rate(self):
        return (self.n_tokens - 1) / (self.last - self.first) if self.n_tokens > 1 else 0.0


def stream_text(tokenizer, tokens, config: GenerationConfig) -> Timing:
    """Print token ids as text as soon as it is final (kvref.generation.stream.TextStream: whole characters, never
    a stop string or an end id's text); return the timing."""
    timing = Timing()
    text = TextStream(tokenizer, config.stop, config.end_ids(tokenizer))
    for token in tokens:
        timing.tick()
        print(text.push(token), end="", flush=True)
    print(text.flush(), end="", flush=True)
    return timing


def add_chat(commands):
    p = commands.add_parser("chat", help="interactive chat that keeps one KV cache across turns",
                            description="An interactive chat over one KV cache: each turn prefills only what the "
                                        "cache does not hold. Ctrl-C stops a reply (the chat goes on); an empty "
                                        "line, Ctrl-D or Ctrl-C at the prompt ends the chat. On a "
                                        "terminal the prompt edits lines and keeps a history (arrow keys, "
                                        "Ctrl-R) where Python has readline. Greedy (deterministic) unless "
                                        "--temperature is given.")
    add_model_arguments(p)
    add_activations_argument(p)
    add_sampling_arguments(p)
    add_runtime_arguments(p, chat=True)
    p.add_argument("--system", default=None, help="system message")
    add_chat_template_argument(p)
    p.set_defaults(run=run_chat)


def run_chat(args) -> int:
    from ..generation.conversation import Conversation

    model = load_text_model(args, chat=True)
    chat = Conversation(model, system=args.system, cache=new_cli_cache(model, args),
                        drop_oldest=args.context_overflow == "truncate")
    config = generation_config(args, model)
    line_editing(sys.stdin)
    notice(args, "one KV cache for the whole conversation; Ctrl-C stops a reply; an empty line, Ctrl-D or "
                 "Ctrl-C here ends the chat")
    while True:
        try:
            text = input("> ")
        except EOFError:  # Ctrl-D
            print()
            return 0
        except KeyboardInterrupt:  # Ctrl-C at the prompt
            print()
            return 130
        if not text.strip():
            return 0
        progress = prefill_progress(args, n_cached=chat.cache.length)
        reply = chat.say(text, config=config, progress=progress)
        try:
            timing = stream_text(model.tokenizer, after_first(reply, progress.done), config)
        except KeyboardInterrupt:
            reply.close()  # the turn ends here: the conversation keeps the reply so far
            progress.done()
            print()
            turn = chat.messages[-1]
            notice(args, f"reply interrupted after {len(turn.get('token_ids', ()))} tokens; the cache keeps its "
                         f"{chat.cache.length} committed positions")
            continue
        except KVRefError as error:
            progress.done()
            print(f"{type(error).__name__}: {error}", file=sys.stderr)
            continue
        print()
        turn = chat.last_turn
        if turn.dropped:
            notice(args, f"the oldest {turn.dropped} messages were dropped to fit --ctx-size "
                         f"{chat.cache.capacity} (--context-overflow truncate)")
        if args.verbose:
            print(f"[reused {turn.reused} cached positions, prefilled {turn.computed} new; "
                  f"decode {timing.decode_rate():.1f} tok/s; cache {chat.cache.length} positions, "
                  f"{human_bytes(chat.cache.nbytes)}]", file=sys.stderr)


def after_first(tokens, action):
    """The tokens, with action() called as the first arrives (the progress line goes before the text)."""
    for i, token in enumerate(tokens):
        if i == 0:
            action()
        yield token


def add_serve(commands):
    p = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching, prefix cache)",
                            description="An OpenAI-compatible server: /v1/completions, /v1/chat/completions "
                                        "(streaming with server-sent events), /v1/models, /health, /metrics. "
                                        "Requests share one pool of KV blocks: they join the running batch at "
                                        "the next step, reuse the blocks of a prompt prefix another request "
                                        "computed, and the newest is preempted (freed, recomputed later) when "
                                        "the pool runs out. Needs the serve extra: pip install 'kvref[serve]'.")
    add_model_arguments(p)
    add_activations_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                                                        "only; 0.0.0.0 opens it to the network)")
    p.add_argument("--port", type=count_in(0, 65535), default=8080, help="port (default 8080)")
    p.add_argument("--threads", type=count_in(1, MAX_THREADS), default=None,
                   help="threads of the native pool (default: KVREF_THREADS, else every usable core)")
    p.add_argument("--kv-dtype", default="float16", choices=KV_DTYPES, help="element type of the cached K/V "
                                                                            "(default float16)")
    room = p.add_mutually_exclusive_group()
    room.add_argument("--num-blocks", type=count_in(1), default=None, help="KV blocks in the pool")
    room.add_argument("--cache-mib", type=count_in(1), default=None,
                      help=f"size the pool in MiB of K/V instead (default {SERVE_CACHE_MIB})")
    p.add_argument("--block-size", type=count_in(1, 1024), default=16, help="positions per KV block (default 16)")
    p.add_argument("--max-batch", type=count_in(1, 1024), default=8,
                   help="sequences in the running batch at most (default 8)")
    p.add_argument("--prefill-chunk", type=count_in(1), default=256,
                   help="prompt positions one step computes at most, so a long prompt does not stall the "
                        "running requests (default 256)")
    p.add_argument("--shutdown-timeout", type=_checked(float, _check_seconds), default=10.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, how long requests in flight may run on before they are "
                        "cancelled (default 10)")
    p.add_argument("--max-tokens", type=count_in(1), default=None,
                   help="the largest max_tokens a request may ask for, and its default (default: no cap; a "
                        "request without max_tokens gets what the context and the pool leave)")
    p.add_argument("--max-body-bytes", type=count_in(1), default=1 << 20, help="request body limit (default 1 MiB)")
    p.add_argument("--api-key", default=os.environ.get("KVREF_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 and /metrics (default: $KVREF_API_KEY; none)")
    p.add_argument("--model-name", default=None, help="the model id clients name (default: the model's short "
                                                      "name, smollm2 for the default model, else its file or "
                                                      "directory name)")
    add_chat_template_argument(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no access log")
    p.set_defaults(run=run_serve)


SERVE_CACHE_MIB = 512


def run_serve(args) -> int:
    try:
        from ..serving import create_server
        from ..serving.protocol import Limits
    except ImportError as error:
        raise ConfigError(f"kvref serve needs the serve extra (pip install 'kvref[serve]'): {error}") from None
    from ..loader import SHORT_NAMES

    model = load_text_model(args, chat=True)  # /v1/chat/completions renders its template: say which
    c = model.config
    per_block = args.block_size * bytes_per_position(c.n_layers, c.n_kv_heads, c.head_dim, args.kv_dtype)
    num_blocks = args.num_blocks or max((args.cache_mib or SERVE_CACHE_MIB) * 2**20 // per_block, 1)
    source = args.model or os.environ.get("KVREF_MODEL")
    if args.model_name is not None:
        name = args.model_name
    elif source is None:
        name = "smollm2"  # the default model, by its short name
    elif source in SHORT_NAMES or not Path(source).exists():  # a short name, or org/name of the HF cache
        name = source
    else:
        name = Path(source).name if Path(source).is_dir() else Path(source).stem
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        notice(args, f"listening on {args.host} without --api-key: anyone who can reach the port can use the model")
    server = create_server(model, name, host=args.host, port=args.port, max_batch=args.max_batch,
                           num_blocks=num_blocks, block_size=args.block_size, kv_dtype=args.kv_dtype,
                           prefill_chunk=args.prefill_chunk, api_key=args.api_key,
                           limits=Limits(max_tokens=args.max_tokens, max_n=min(16, args.max_batch)),
                           max_body_bytes=args.max_body_bytes, log_level="warning" if args.quiet else "info",
                           shutdown_timeout=args.shutdown_timeout)
    notice(args, f"serving {name!r} at http://{args.host}:{args.port}/v1 ({num_blocks} blocks of {args.block_size} "
                 f"positions, {human_bytes(num_blocks * per_block)} of {args.kv_dtype} K/V, batch {args.max_batch}, "
                 f"backend {model.backend}, {model.activations or 'float32'} activations)")
    server.run()
    return 0
