"""The inference server on a transformers causal LM: a tiny randomly initialised GPT-2 and a tokenizer trained
here (nothing can be downloaded), saved with save_pretrained, served in this process and as a real replica."""

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import openai
import pytest
import torch

from runners.workloads.serve_engine import Engine, PrefixCache
from runners.workloads.serve_hf import HFRunner, plain_chat
from runners.workloads.serve_settings import Settings
from tests.workloads.test_serve import REPO, ServerProcess

pytestmark = pytest.mark.e2e

LINES = [
    "the quick brown fox jumps over the lazy dog",
    "a gpu portal serves models at the edge of the cluster",
    "you are the portal's assistant: answer briefly and kindly",
    "hello world, what is a gpu and how many do i have?",
]
SYSTEM = "you are the portal's assistant: answer briefly and kindly. the cluster has gpus. "


def build_model(folder: Path, *, chat_template: str | None = None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(LINES * 4, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    if chat_template:
        tokenizer.chat_template = chat_template
    torch.manual_seed(0)
    # A wide initialisation: the logits of a random model are far apart, so greedy choices are not near-ties
    # that the order of floating-point sums could flip.
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=512, vocab_size=len(tokenizer),
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id, initializer_range=0.5)
    GPT2LMHeadModel(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("tiny-gpt2"))


def reference_ids(folder: Path, prompt: str, max_tokens: int) -> list[int]:
    """transformers' own greedy generation, one prompt alone, up to its end-of-sequence token (left out)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    new = out[0, ids.shape[1]:].tolist()
    return new[: new.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in new else new


def reference(folder: Path, prompt: str, max_tokens: int) -> str:
    """What the server must answer: transformers' greedy text for the prompt alone."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).decode(reference_ids(folder, prompt, max_tokens), skip_special_tokens=True)


def engine(folder: Path, settings: Settings | None = None) -> Engine:
    settings = settings or Settings()
    cache = PrefixCache(int(settings.prefix_cache_mib * 1024 * 1024), settings.prefix_block)
    e = Engine(HFRunner(folder, torch.device("cpu"), cache), None, settings)
    e.start()
    return e


def finish(seq, timeout=60):
    assert seq.done.wait(timeout), "no answer"
    assert seq.status == 200, (seq.status, seq.detail)
    return seq


# --- the engine, in this process -----------------------------------------------------------------


def test_batched_greedy_decoding_answers_what_transformers_generates_for_each_prompt_alone(folder):
    prompts = ["hello world", "the quick brown fox jumps over", "a gpu", SYSTEM + "how many gpus?"]
    e = engine(folder, Settings(max_batch_wait_ms=50, prefix_cache_mib=0))
    runner = e.runner
    # Submitted together: they join one batch (left-padded to the longest) and step together.
    seqs = [e.submit(runner.encode(p), 12, 60_000) for p in prompts]
    for seq in seqs:
        finish(seq)
    assert e.peak_batch_tokens == sum(len(runner.encode(p)) + 12 for p in prompts)
    for prompt, seq in zip(prompts, seqs):
        expected = reference_ids(folder, prompt, 12)
        assert seq.out == expected, prompt
        assert seq.finish_reason == ("length" if len(expected) == 12 else "stop")
    assert any(seq.finish_reason == "stop" for seq in seqs)  # one met the end-of-sequence token, and stopped there


def test_the_prefix_cache_changes_nothing_but_the_work_done(folder):
    prompts = [SYSTEM + q for q in ("what is a gpu?", "how many do i have?", "hello", "the edge of the cluster")]
    outputs = {}
    for mib in (0, 8):
        e = engine(folder, Settings(prefix_cache_mib=mib, prefix_block=4, max_batch_wait_ms=0))
        outs = []
        for p in prompts:  # one at a time, so each can find what the one before left
            outs.append(finish(e.submit(e.runner.encode(p), 10, 60_000)).text)
        outputs[mib] = outs
        if mib:
            shared = len(e.runner.encode(SYSTEM)) // 4 * 4 - 4  # the aligned blocks every prompt surely shares
            assert e.cache.hits == 3 and e.cache.tokens_saved >= 3 * shared > 0
        else:
            assert e.cache.hits == 0 and not e.cache.entries
    assert outputs[0] == outputs[8]
    assert outputs[0][0] == reference(folder, prompts[0], 10)


def test_sampling_follows_the_temperature_and_a_seed_repeats_it(folder):
    e = engine(folder)
    prompt = e.runner.encode("hello world")
    draw = [finish(e.submit(prompt, 16, 60_000, temperature=1.5, seed=seed)).out for seed in (7, 7, 8)]
    greedy = finish(e.submit(prompt, 16, 60_000)).out
    assert draw[0] == draw[1]
    assert draw[0] != draw[2] and draw[0] != greedy


def test_stop_strings_and_the_end_of_sequence_token_end_an_answer(folder):
    e = engine(folder)
    full = finish(e.submit(e.runner.encode("a gpu"), 12, 60_000)).text
    stop = full[4:7]
    assert stop and full.index(stop) >= 1
    cut = finish(e.submit(e.runner.encode("a gpu"), 12, 60_000, stop=[stop]))
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"


# --- a real replica --------------------------------------------------------------------------------


def test_a_replica_serves_the_folder_and_its_tar_gz_through_the_openai_client(folder, tmp_path):
    archive = tmp_path / "weights"  # named by its hash in a node's cache: no suffix to tell it by
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="model")
    expected = reference(folder, "hello world", 8)
    for source in (folder, archive):
        server = ServerProcess(source, "--max-tokens", 64)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
            answer = client.completions.create(model="tiny", prompt="hello world", max_tokens=8)
            assert answer.choices[0].text == expected and answer.choices[0].finish_reason == "length"
            assert answer.model == "tiny"
            assert answer.usage.completion_tokens == 8 and answer.usage.prompt_tokens == len(_encode(folder, "hello world"))
            streamed = client.completions.create(model="tiny", prompt="hello world", max_tokens=8, stream=True)
            assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
            # A chat with no template in the tokenizer: the plain "role: content" lines.
            messages = [{"role": "user", "content": "what is a gpu?"}]
            chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
            assert chat.choices[0].message.content == reference(folder, plain_chat(messages), 6)
            assert chat.usage.prompt_tokens == len(_encode(folder, plain_chat(messages)))
            status, _, body = server.generate({"prompt": "hello world", "max_tokens": 8})
            assert status == 200 and body["text"] == expected and body["tokens"] == 8
        finally:
            server.stop()


def test_a_chat_template_in_the_tokenizer_renders_the_chat(tmp_path):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    folder = build_model(tmp_path / "chatty", chat_template=template)
    server = ServerProcess(folder, "--max-tokens", 16)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
        chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5)
        rendered = "<system>be brief\n<user>hello\n<assistant>"
        assert chat.usage.prompt_tokens == len(_encode(folder, rendered))
        assert chat.choices[0].message.content == reference(folder, rendered, 5)
    finally:
        server.stop()


def test_a_tar_gz_that_reaches_outside_its_folder_is_not_unpacked_and_the_replica_exits_1(tmp_path):
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = b"{}"
        member = tarfile.TarInfo("../outside/config.json")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    done = subprocess.run(
        [sys.executable, "-m", "runners.workloads.serve", "--checkpoint", str(archive), "--port", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1
    assert "outside" in done.stderr
    assert not (tmp_path / "outside").exists()


def _encode(folder: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).encode(text)

