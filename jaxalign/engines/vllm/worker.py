"""The vLLM worker: run by the vLLM environment's Python (`.venv-vllm/bin/python worker.py`), never imported by
jaxalign. It holds one `vllm.LLM` (core in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0) and answers one JSON request
per line on stdin with one JSON line on the protocol stream (the stdout it was started with; vLLM's own output is
moved to stderr). Only JSON crosses the pipe, both ways: nothing is pickled.

It never outlives its parent: PR_SET_PDEATHSIG (SIGKILL) is set first thing, the parent's pid is checked right
after (the parent may have died before that), a thread polls the parent pid, and end of stdin ends the worker.

Requests (`cmd`): `load` {model, dtype, seed, max_model_len, max_num_seqs, logprobs_mode} builds the LLM (again,
dropping the old one); `generate` {prompts, max_new_tokens, temperature, top_k, top_p, eos_id, seed, batch_size};
`score` {sequences}: each token's prompt logprob (the sync probe); `reload_inplace` {model}: vLLM's in-place
`reload_weights` from a checkpoint directory (kept to show its fault, docs/vllm.md); `exit`.
Answers: {"ok": true, ...} or {"ok": false, "error": "..."}.
"""

import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the poll below still ends the worker
    if os.getppid() != parent:
        os._exit(3)

    def poll():
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=poll, daemon=True).start()


def _protocol_stream():
    """The stream answers go to (the stdout the worker was started with); fd 1 becomes stderr so vLLM's and
    torch's prints cannot interleave with the protocol."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


class Worker:
    def __init__(self):
        self.llm = None
        self.version = None

    def load(self, model, dtype, seed, max_model_len, max_num_seqs, logprobs_mode="processed_logprobs"):
        import gc

        import vllm
        start = time.perf_counter()
        if self.llm is not None:
            self.llm = None
            gc.collect()
        self.llm = vllm.LLM(model=model, skip_tokenizer_init=True, dtype=dtype, seed=seed,
                            max_model_len=max_model_len, max_num_seqs=max_num_seqs, enforce_eager=True,
                            logprobs_mode=logprobs_mode, enable_prefix_caching=False)
        self.version = vllm.__version__
        return {"version": self.version, "seconds": time.perf_counter() - start}

    def _params(self, **kw):
        import vllm
        return vllm.SamplingParams(**kw)

    def generate(self, prompts, max_new_tokens, temperature, top_k, top_p, eos_id, seed, batch_size):
        from vllm.inputs import TokensPrompt
        start = time.perf_counter()
        outputs = []
        step = batch_size or len(prompts)
        for first in range(0, len(prompts), step):
            chunk = prompts[first: first + step]
            params = [self._params(n=1, temperature=temperature, top_k=top_k if top_k else 0,
                                   top_p=1.0 if top_p is None else top_p, max_tokens=max_new_tokens,
                                   min_tokens=0, logprobs=0, seed=seed * 1_000_003 + first + i, detokenize=False,
                                   ignore_eos=eos_id is None,
                                   stop_token_ids=[] if eos_id is None else [eos_id])
                      for i in range(len(chunk))]
            done = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in chunk], params, use_tqdm=False)
            for out in done:
                c = out.outputs[0]
                tokens = list(c.token_ids)
                logprobs = [float(lp[t].logprob) for t, lp in zip(tokens, c.logprobs)]
                outputs.append({"tokens": tokens, "logprobs": logprobs, "finish_reason": c.finish_reason})
        return {"outputs": outputs, "seconds": time.perf_counter() - start}

    def score(self, sequences):
        from vllm.inputs import TokensPrompt
        params = self._params(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False, seed=0)
        done = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
        scores = []
        for seq, out in zip(sequences, done):
            lps = out.prompt_logprobs  # entry 0 is None (the first token has no context)
            scores.append([float(lps[t][seq[t]].logprob) for t in range(1, len(seq))])
        return {"logprobs": scores}

    def reload_inplace(self, model):
        import glob

        from safetensors.torch import load_file

        start = time.perf_counter()

        def weights():
            for path in sorted(glob.glob(os.path.join(model, "*.safetensors"))):
                yield from load_file(path).items()

        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights(),
                                                          "is_checkpoint_format": True})
        return {"seconds": time.perf_counter() - start}


def main():
    _die_with_parent(int(os.environ.get("JAXALIGN_PARENT_PID", os.getppid())))
    proto = _protocol_stream()
    worker = Worker()
    proto.write(json.dumps({"ok": True, "ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            cmd = request.pop("cmd")
            if cmd == "exit":
                proto.write(json.dumps({"ok": True}) + "\n")
                break
            if cmd not in ("load", "generate", "score", "reload_inplace"):
                raise ValueError(f"unknown command {cmd!r}")
            answer = {"ok": True, **getattr(worker, cmd)(**request)}
        except Exception as err:  # the parent reports it; the worker stays usable
            traceback.print_exc(file=sys.stderr)
            answer = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        proto.write(json.dumps(answer) + "\n")
    proto.flush()
    os._exit(0)  # skip vLLM's atexit work: the parent is waiting on this process, nothing else is left


if __name__ == "__main__":
    main()
