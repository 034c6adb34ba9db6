"""The openai-http adapter: any OpenAI-compatible server, by URL (kvref serve, llama.cpp's server, vLLM, SGLang).

A sequence is its token history, kept here; the server keeps nothing the suite relies on. The rows of
new positions come from one POST /v1/completions per position, with the history up to that position
as a token-id prompt:

    {"model": M, "prompt": [ids...], "max_tokens": 1, "temperature": 0, "logprobs": K}

choices[0].logprobs.top_logprobs[0] holds the K most likely next tokens of the prompt's last position.
(echo with logprobs would give every prompt position at once, but servers differ: kvref serve and
llama.cpp's server refuse it, llama-cpp-python's pairs each token with the wrong position.) A server that
refuses token-id prompts by naming `prompt` (llama-cpp-python's) gets their text instead, and must read it
as the same ids (checked through its /extras/tokenize, where it has one) and as many tokens (usage). The server's top-k keys are token texts; they map back to ids through
the spec's tokenizer, or come as "token_id:N" where the server takes vLLM's return_tokens_as_token_ids
(asked for first, with ignore_eos; each dropped if the server refuses it). A text several ids decode
to is left out of the k tokens, so it falls into "the rest" on both sides (spec.py's coarsening stays
exact). A reply with no top_logprobs entry (llama-cpp-python's server leaves out the entries of its BOS
id) makes that position a missing row, with the reply's finish_reason in its reason: the
checks compare the other positions and list it as skipped. What the adapter can do: golden and greedy
checks on top-k rows, and prefix_cache against the spec (requests that share prefixes, as the server's
cache sees them; it cannot be asked to compute cold); no other cache operation is reachable through the
API, so those checks are skipped.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np

from ..generation.conversation import shared_prefix
from .engine import ConformanceError, Engine, Refused, Rows

# Extensions asked for, each dropped if the server refuses it by name: token ids as logprob keys (vLLM,
# kvref serve), and going on past an end-of-sequence token, whose step's logprobs some servers leave out
# when they stop there (kvref serve does); llama.cpp's server and vLLM take ignore_eos too.
EXTRAS = {"return_tokens_as_token_ids": True, "ignore_eos": True}
TOP_K = 20  # OpenAI's limit for top logprobs on completions is 5 on some servers, 20 on most
PROBE = [0]  # the prompt of the first request, which finds what the server takes
# llama-cpp-python's server: {"input": text} -> {"tokens": ids}, the ids its completions read the text as
TOKENIZE = "/extras/tokenize"
TIMEOUT = 300  # seconds per request: a slow server prefilling on a CPU


class OpenAIHTTPEngine(Engine):
    name = "openai-http"
    capabilities = frozenset({"incremental", "prefix_cache"})

    def __init__(self, url: str, spec, top_k: int = TOP_K, model: str | None = None, precision: str = "float32",
                 api_key: str | None = None):
        if not url.startswith(("http://", "https://")):
            raise ConformanceError(f"--url {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        self.top_k = top_k
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.id_keys = False  # whether the last reply keyed its top logprobs "token_id:N" (else token texts)
        self.precision = precision  # the server's arithmetic is not observable: the caller says which bounds apply
        self.model = model or self._served_model()
        self.ids_of = piece_ids(spec.model.tokenizer) if spec.model.tokenizer is not None else {}
        self.requests = 0
        self.extras = dict(EXTRAS)
        self.decode = spec.model.tokenizer.decode if spec.model.tokenizer is not None else None
        self.text_prompts = False  # True when the server refuses token-id prompts (llama-cpp-python's server)
        self.tokenizes = False  # True when the server answers TOKENIZE: text prompts are then checked id by id
        self._probe()

    def describe(self) -> dict:
        return {"engine": "openai-http", "url": self.url, "model": self.model, "top_logprobs": self.top_k,
                "bounds": self.precision,
                "rows": "one /v1/completions request per position",
                "extensions": ", ".join(self.extras) or "none",
                "keys": "token ids" if self.id_keys else "token texts, mapped to ids by the spec's tokenizer",
                "prompts": self._prompts_note()}

    def new_sequence(self):
        return []

    def forward(self, seq, ids, last_only=False) -> Rows:
        ids = [int(t) for t in ids]
        start = len(ids) - 1 if last_only else 0
        rows = [self._next(seq + ids[:j + 1]) for j in range(start, len(ids))]
        seq.extend(ids)
        missing = {j: why for j, (_, _, why) in enumerate(rows) if why is not None}
        return Rows(top_ids=np.array([r[0] for r in rows]), top_logprobs=np.array([r[1] for r in rows]),
                    missing=missing)

    def prefill_cached(self, ids):
        # a server reuses prefixes (or not) on its own; how many positions it reused is not reported
        seq = self.new_sequence()
        return seq, self.forward(seq, ids), -1

    def prefill_cold(self, ids):
        raise Refused("a server offers no request that bypasses its prefix cache")

    def _next(self, prompt):
        # -> ([k] ids, [k] log-probabilities) of the next token after prompt, most likely first, and None;
        # or placeholders and why, where the server answered without that distribution
        body = {"model": self.model, "prompt": self._prompt(prompt), "max_tokens": 1, "temperature": 0,
                "logprobs": self.top_k}
        body.update(self.extras)
        reply = self._post("/v1/completions", body)
        try:
            choice = reply["choices"][0]
            entries = choice["logprobs"]["top_logprobs"]
        except (KeyError, IndexError, TypeError, AttributeError):
            raise ConformanceError(f"{self.url}/v1/completions answered without choices[0].logprobs.top_logprobs: "
                                   f"{json.dumps(reply)[:300]}") from None
        if self.text_prompts:
            self._check_prompt_tokens(reply, prompt)
        if not entries:
            # llama-cpp-python's server leaves out every entry of its BOS id (finish_reason "length"), and
            # ends at an end token without its entry (finish_reason "stop"; ignore_eos unknown to it)
            why = f"the reply has no log-probabilities, finish_reason {choice.get('finish_reason')!r}"
            return [0] * self.top_k, [-np.inf] * self.top_k, why
        self.id_keys = all(text.startswith("token_id:") for text in entries[0])
        pairs = [(self._id(text), float(lp)) for text, lp in entries[0].items()]
        # most likely first; a server may add the chosen token's entry past the k asked for (llama-cpp-python)
        pairs = sorted(((i, lp) for i, lp in pairs if i is not None), key=lambda p: -p[1])[:self.top_k]
        if not pairs:
            raise ConformanceError(f"none of the server's top tokens maps to one id: {list(entries[0])[:5]}")
        pad = self.top_k - len(pairs)  # texts left out: padded with a repeat of nothing (probability 0)
        ids = [i for i, _ in pairs] + [pairs[-1][0]] * pad
        lps = [lp for _, lp in pairs] + [-np.inf] * pad
        return ids, lps, None

    def _prompt(self, ids):
        return self.decode(ids) if self.text_prompts else ids

    def _prompts_note(self) -> str:
        if not self.text_prompts:
            return "token ids"
        if self.tokenizes:
            return f"text, its tokenization ({TOKENIZE}) checked against the ids"
        return "text, checked by the server's prompt token count only"

    def _check_prompt_tokens(self, reply, prompt):
        # the server tokenized the text itself: it must have read the ids the text stands for (where it says
        # which ids it reads a text as), and as many tokens (usage.prompt_tokens, which every server reports)
        if self.tokenizes:
            read = self._post(TOKENIZE, {"model": self.model, "input": self.decode(prompt)}).get("tokens") or []
            if read != list(prompt):
                at = shared_prefix(read, prompt)
                raise ConformanceError(f"the server tokenizes the text of {len(prompt)} token ids as other ids (from "
                                       f"position {at}: {read[at:at + 3]} for {list(prompt[at:at + 3])}); it takes "
                                       "no token-id prompts, so its rows are not the spec's positions")
        read = (reply.get("usage") or {}).get("prompt_tokens")
        if read != len(prompt):
            raise ConformanceError(f"the server read the text of {len(prompt)} token ids as {read} tokens; it takes no "
                                   "token-id prompts, so its rows cannot be matched to the spec's positions")

    def _answers_tokenize(self) -> bool:
        try:
            return isinstance(self._post(TOKENIZE, {"model": self.model, "input": self.decode(PROBE)}).get("tokens"),
                              list)
        except (ConformanceError, AttributeError):
            return False

    def _probe(self):
        # ask with every extension; drop each one the server refuses by name, then ask again; a server that
        # refuses token-id prompts gets their text (llama-cpp-python's server takes only strings)
        while True:
            try:
                self._next(PROBE)
                return
            except ConformanceError as refusal:
                named = [field for field in self.extras if field in str(refusal)]
                if named:
                    del self.extras[named[0]]
                elif "prompt" in str(refusal) and not self.text_prompts and self.decode is not None:
                    self.text_prompts = True
                    self.tokenizes = self._answers_tokenize()
                else:
                    raise

    def _id(self, text):
        if text.startswith("token_id:"):
            return int(text.split(":", 1)[1])
        ids = self.ids_of.get(text)
        return ids[0] if ids is not None and len(ids) == 1 else None

    def _served_model(self) -> str:
        try:
            models = self._get("/v1/models")
            return models["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise ConformanceError(f"{self.url}/v1/models lists no model") from None

    def _get(self, path):
        return self._call(urllib.request.Request(self.url + path, headers=self.headers))

    def _post(self, path, body):
        self.requests += 1
        return self._call(urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                                 headers={"Content-Type": "application/json", **self.headers}))

    def _call(self, request):
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise ConformanceError(f"{request.full_url}: HTTP {exc.code}: {exc.read()[:300]!r}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ConformanceError(f"{request.full_url}: {exc}") from None


def piece_ids(tokenizer) -> dict:
    """{text one id decodes to: [ids that decode to it]} over the vocabulary."""
    out = {}
    for i in range(tokenizer.vocab_size):
        out.setdefault(tokenizer.decode([i]), []).append(i)
    return out

