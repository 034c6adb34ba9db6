"""Load test of `kvref serve`: concurrent streaming clients over loopback, checked against references.

    python benchmarks/serve_load.py                       # starts a server in this process (SmolLM2)
    python benchmarks/serve_load.py --url http://127.0.0.1:8080 --model smollm2   # an external server
    python benchmarks/serve_load.py --url http://127.0.0.1:8081 --model m --text   # a server without token ids

--text is for servers that cannot return token ids (llama-cpp-python's llama_cpp.server): responses are
compared with their references by text, each streamed chunk counts as one token, and the figures only
kvref's /metrics gives (prefix hits, batch sizes, blocks) are left out.

The workload: every request is a completion whose prompt is one shared system prompt followed by a
question of its own, of mixed length (1 to 12 sentences), with max_tokens 16 to 48, greedy. Two
passes over the same requests:

  1. reference: each request alone (one at a time), its token ids (return_tokens_as_token_ids);
  2. load: --clients clients at once, each sending its --requests-per-client requests in turn.

Reported: wall time, throughput (generated tokens/s, requests/s), time to first token (send -> the first
streamed token) and per-token latency (gaps between a request's later tokens), p50 / p99 of each, the
prefix-cache hit rate during the load pass (/metrics), the number of responses that equal their
reference token for token, and those that differ: at a near tie (kvref.tolerance.near_tie of the
reference logits at the first differing step, when the server runs in this process) or not. Lost or
duplicated responses, and blocks still in use once idle, are errors. Nothing here is a unit test:
the figures depend on the machine (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time

import httpx

SYSTEM = ("You are the help desk of a public library. You answer questions about opening hours, borrowing "
          "rules, the catalogue, the reading rooms and the events programme. Answers are short, plain and "
          "polite; when you do not know, you say so and point to the front desk. ")
SENTENCES = ["I would like to know something.", "My card expired last month.", "I have three books at home.",
             "One of them is a large atlas.", "The reading room was full yesterday.", "I study there every day.",
             "My daughter wants to join too.", "She is nine years old.", "We live across the river.",
             "The bus stops near the north entrance.", "I also use the printers sometimes.",
             "Last week the printer was broken."]


def workload(clients: int, per_client: int):
    """[(client, prompt text, max_tokens)] in each client's order; prompt lengths and budgets mixed."""
    jobs = []
    for c in range(clients):
        for r in range(per_client):
            k = (c * 7 + r * 3) % len(SENTENCES) + 1
            question = " ".join(SENTENCES[(c + j) % len(SENTENCES)] for j in range(k))
            prompt = f"{SYSTEM}\nVisitor {c}.{r}: {question} What should I do?\nAnswer:"
            jobs.append((c, prompt, 16 + (c * 5 + r * 11) % 33))
    return jobs


async def complete(client, url, model, prompt, max_tokens, text=False):
    """One streamed greedy completion: (token ids, or the text with `text`, send time, [arrival time
    of each token])."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0}
    if not text:
        body.update(logprobs=0, return_tokens_as_token_ids=True)
    ids, pieces, arrivals, done = [], [], [], 0
    start = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done += 1
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for choice in chunk["choices"]:
                now = time.perf_counter()
                if text:
                    if choice.get("text"):
                        pieces.append(choice["text"])
                        arrivals.append(now)
                    continue
                for t in (choice.get("logprobs") or {}).get("tokens") or []:
                    ids.append(int(t.removeprefix("token_id:")))
                    arrivals.append(now)
    if done != 1:
        raise RuntimeError(f"a stream ended with {done} [DONE] markers")
    return ("".join(pieces) if text else ids), start, arrivals


async def reference_pass(url, model, jobs, text):
    async with httpx.AsyncClient(timeout=600) as client:
        return [(await complete(client, url, model, p, n, text))[0] for _, p, n in jobs]


async def load_pass(url, model, jobs, clients, text):
    results = [None] * len(jobs)

    async def run_client(c, client):
        for i, (owner, prompt, n) in enumerate(jobs):
            if owner == c:
                if results[i] is not None:
                    raise RuntimeError(f"request {i} answered twice")
                results[i] = await complete(client, url, model, prompt, n, text)

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(run_client(c, client) for c in range(clients)))
        return results, time.perf_counter() - started


def metrics(url) -> dict:
    """kvref's /metrics as {name: value}; {} from a server without it"""
    response = httpx.get(url + "/metrics")
    if response.status_code != 200:
        return {}
    text = response.text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def kvref_figures(before, after, idle) -> dict:
    """What kvref's /metrics adds over the load pass (nothing for another server)."""
    if not after:
        return {}
    queries = after["kvref_prefix_cache_queries_total"] - before["kvref_prefix_cache_queries_total"]
    hits = after["kvref_prefix_cache_hits_total"] - before["kvref_prefix_cache_hits_total"]
    batch = (after["kvref_batch_size_sum"] - before["kvref_batch_size_sum"]) / max(
        1, after["kvref_batch_size_count"] - before["kvref_batch_size_count"])
    return {"mean_batch": round(batch, 2), "prefix_hit_rate": round(hits / queries, 3) if queries else None,
            "preemptions": after["kvref_preemptions_total"] - before["kvref_preemptions_total"],
            "blocks_in_use_idle": idle['kvref_blocks{state="in_use"}'],
            "blocks_cached_idle": idle['kvref_blocks{state="cached"}']}


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))] if values else float("nan")


def start_server(args):
    import kvref
    from kvref.serving import bind, create_server

    model = kvref.load(args.model_path, threads=args.threads)
    server = create_server(model, args.model, max_batch=args.max_batch, num_blocks=args.num_blocks,
                           kv_dtype=args.kv_dtype, log_level="warning")
    sock = bind("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", model, server, thread


def classify(model, jobs, references, results):
    """(equal, near ties, wrong): responses against their references; near ties need the model here."""
    from kvref.tolerance import near_tie

    equal, ties, wrong = 0, [], []
    for i, ((_, prompt, n), want, (got, _, _)) in enumerate(zip(jobs, references, results)):
        if got == want:
            equal += 1
            continue
        step = next((s for s, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        if model is not None and step < min(len(got), len(want)):
            ids = model.tokenizer.encode(prompt, add_special=True) + want[:step]
            if near_tie(model.forward(ids)):
                ties.append((i, step))
                continue
        wrong.append((i, step))
    return equal, ties, wrong


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="an external server (default: start one in this process)")
    p.add_argument("--model", default="smollm2", help="the model id the server serves")
    p.add_argument("--model-path", default=None, help="model to load in this process (default: the default model)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--kv-dtype", default="float16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--text", action="store_true", help="compare responses by text (a server without token ids)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = p.parse_args(argv)

    model = server = None
    url = args.url
    if url is None:
        url, model, server, _ = start_server(args)
    jobs = workload(args.clients, args.requests_per_client)
    print(f"{len(jobs)} requests from {args.clients} clients; reference pass (one at a time)...", file=sys.stderr)
    references = asyncio.run(reference_pass(url, args.model, jobs, args.text))
    before = metrics(url)
    print("load pass...", file=sys.stderr)
    results, wall = asyncio.run(load_pass(url, args.model, jobs, args.clients, args.text))
    after = metrics(url)
    time.sleep(0.2)
    idle = metrics(url)

    tokens = sum(len(arrivals) for _, _, arrivals in results)
    ttft = [arrivals[0] - start for _, start, arrivals in results if arrivals]
    gaps = [b - a for _, _, arrivals in results for a, b in zip(arrivals, arrivals[1:])]
    equal, ties, wrong = classify(None if args.text else model, jobs, references, results)
    figures = {
        "requests": len(jobs), "clients": args.clients, "wall_s": round(wall, 2), "generated_tokens": tokens,
        "throughput_tok_s": round(tokens / wall, 1), "requests_s": round(len(jobs) / wall, 2),
        "ttft_p50_ms": round(1e3 * percentile(ttft, 50), 1), "ttft_p99_ms": round(1e3 * percentile(ttft, 99), 1),
        "per_token_p50_ms": round(1e3 * percentile(gaps, 50), 1),
        "per_token_p99_ms": round(1e3 * percentile(gaps, 99), 1),
        "equal_to_reference": equal, "near_ties": ties, "wrong": wrong, **kvref_figures(before, after, idle),
    }
    if args.json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key:>22}: {value}")
    if server is not None:
        server.should_exit = True
    return 1 if wrong or figures.get("blocks_in_use_idle") else 0


if __name__ == "__main__":
    sys.exit(main())
