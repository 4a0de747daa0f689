"""train.prepare: corpora (text, JSON Lines, gzip, Parquet) -> a token file, its sidecar and
tokenizer; BOS/EOS per document, undecodable input, workers, interruptions, the guarantees."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT
from train import prepare as prep
from train.data import read_token_header


def docs(n=120):
    """``n`` short documents of varied text (some non-ASCII)."""
    words = "the cat sat on a mat while ein Hund über die Straße lief und 猫 は 寝る".split()
    rng = np.random.default_rng(0)
    return [" ".join(words[j] for j in rng.integers(0, len(words), int(rng.integers(3, 20)))) + f" {i}.\nend"
            for i in range(n)]


def bpe(specials=("<s>", "</s>"), vocab=300):
    """A byte-level BPE trained here (any text encodes) with ``specials``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs(), trainer=trainer)
    return tok


def tokenizer_folder(path, config):
    """A Hugging Face tokenizer folder: tokenizer.json (BPE with <s>, </s>) + tokenizer_config.json."""
    path.mkdir()
    bpe().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


def write_jsonl(path, texts, key="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, key: t}) + "\n")
    return str(path)


def write_parquet(path, texts, key="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(texts))), key: texts}), str(path), row_group_size=16)
    return str(path)


def corpus(tmp_path, texts):
    """The same documents as JSON Lines, gzip JSON Lines and Parquet (7+ row groups)."""
    return [write_jsonl(tmp_path / "a.jsonl", texts), write_jsonl(tmp_path / "b.jsonl.gz", texts, opener=gzip.open),
            write_parquet(tmp_path / "c.parquet", texts)]


def tokens(out):
    meta = read_token_header(out)
    return np.fromfile(out, dtype=meta["dtype"]).tolist(), meta


def run(args, capsys):
    """``python -m train.prepare ARGS --no-progress``: (exit status, stderr lines)."""
    capsys.readouterr()
    rc = prep.main([*args, "--no-progress"])
    return rc, capsys.readouterr().err.strip().splitlines()


def test_jsonl_gzip_parquet_get_bos_and_eos_around_every_document(tmp_path):
    texts = docs()
    folder = tokenizer_folder(tmp_path / "tok", {"bos_token": "<s>", "add_bos_token": True,
                                                 "eos_token": {"content": "</s>", "special": True}})
    long_text = "".join(f"line {i} of one long text document\n" for i in range(400))  # ~14 kB
    (tmp_path / "long.txt").write_text(long_text)
    files = corpus(tmp_path, texts) + [str(tmp_path / "long.txt"), write_jsonl(tmp_path / "long.ndjson", [long_text])]
    out = str(tmp_path / "c.bin")
    meta = prep.prepare(files, out, tokenizer=folder, chunk_mb=1 / 1024, workers=1)  # 1 KiB pieces
    tok = bpe()
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    assert (meta["bos_id"], meta["eos_id"]) == (bos, eos) == (0, 1)
    assert meta["version"] == prep.VERSION == 3 and meta["documents"] == 3 * len(texts) + 2
    ids, header = tokens(out)
    assert header["bos_id"] == bos and header["tokens"] == len(ids)

    def doc(t):
        return [bos] + tok.encode(t, add_special_tokens=False).ids + [eos]

    one = [i for t in texts for i in doc(t)]
    # A text file is one document, encoded in pieces cut after a newline: the same ids as the
    # same text in a JSON line (and, this text, as encoding it whole).
    long_ids = ids[3 * len(one):]
    assert ids[:3 * len(one)] == one * 3
    assert long_ids[:len(long_ids) // 2] == long_ids[len(long_ids) // 2:] == doc(long_text)
    assert ids.count(bos) == ids.count(eos) == meta["documents"]
    assert tok.decode(doc(texts[5])[1:-1]) == texts[5]


def test_bos_follows_the_config_or_the_tokenizer_and_eos_is_always_added(tmp_path):
    from tokenizers import processors

    texts = docs(10)
    src = write_jsonl(tmp_path / "a.jsonl", texts)
    tok = bpe()
    # GPT-2 style: bos = eos, add_bos_token not given, nothing prepended by the tokenizer: EOS only.
    gpt2 = tokenizer_folder(tmp_path / "gpt2", {"bos_token": "</s>", "eos_token": "</s>"})
    meta = prep.prepare([src], str(tmp_path / "g.bin"), tokenizer=gpt2, workers=1)
    assert meta["bos_id"] is None and tokens(str(tmp_path / "g.bin"))[0] == [
        i for t in texts for i in tok.encode(t).ids + [1]]
    # add_bos_token not given, the tokenizer's post-processor prepends <s>: BOS too; add_eos_token
    # false does not remove the document separator; --eos replaces it.
    tp = tmp_path / "tp"
    tp.mkdir()
    t2 = bpe()
    t2.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    t2.save(str(tp / "tokenizer.json"))
    (tp / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                          "add_eos_token": False}))
    meta = prep.prepare([src], str(tmp_path / "t.bin"), tokenizer=str(tp), workers=1, eos="<s>")
    assert (meta["bos_id"], meta["eos_id"]) == (0, 0)
    assert tokens(str(tmp_path / "t.bin"))[0][:len(tok.encode(texts[0]).ids) + 2] == [0, *tok.encode(texts[0]).ids, 0]
    # The same tokenizer.json alone (no config naming a bos_token): the post-processor's <s> still starts each one.
    meta = prep.prepare([src], str(tmp_path / "bare.bin"), tokenizer=str(tp / "tokenizer.json"), workers=1, eos="</s>")
    assert (meta["bos_id"], meta["eos_id"]) == (0, 1)


def batches(monkeypatch):
    """How many tasks :mod:`train.prepare` encodes at a time from now on (a list that fills)."""
    sizes, real = [], prep._encode_tasks
    monkeypatch.setattr(prep, "_encode_tasks", lambda tasks, state: sizes.append(len(tasks)) or real(tasks, state))
    return sizes


def test_output_bytes_are_the_same_for_any_number_of_workers(tmp_path, capsys, monkeypatch):
    sizes = batches(monkeypatch)
    texts = docs(300)
    folder = tokenizer_folder(tmp_path / "tok", {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    files = corpus(tmp_path, texts)
    metas, most = [], []
    for w in (1, 4):
        out, sizes[:] = str(tmp_path / f"w{w}.bin"), []
        # 512-byte pieces: dozens of tasks, encoded 4 at a time by the tokenizer's threads.
        rc, err = run([*files, "--out", out, "--tokenizer", folder, "--workers", str(w), "--chunk-mb", str(1 / 2048)],
                      capsys)
        assert rc == 0 and err == [], err
        metas.append({k: v for k, v in tokens(out)[1].items() if k != "tokenizer"})
        most.append(max(sizes))
    assert open(tmp_path / "w1.bin", "rb").read() == open(tmp_path / "w4.bin", "rb").read()
    assert metas[0] == metas[1] and metas[0]["documents"] == 900
    assert most == [1, 4]  # the second run encoded 4 tasks at a time
    # The command itself, quietly.
    out = str(tmp_path / "cli.bin")
    p = subprocess.run([sys.executable, "-m", "train.prepare", *files, "--out", out, "--tokenizer", folder,
                        "--workers", "3", "--chunk-mb", str(1 / 2048)], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0 and p.stderr == "" and "900 document(s) in 3 file(s)" in p.stdout, p.stderr
    assert open(out, "rb").read() == open(tmp_path / "w1.bin", "rb").read()


def test_workers_size_the_tokenizers_thread_pool_unless_the_user_did(monkeypatch):
    seen = []
    monkeypatch.setattr(prep, "prepare", lambda *a, **k: seen.append(os.environ.get("RAYON_NUM_THREADS"))
                        or {"tokens": 2, "dtype": "uint16", "vocab": 300, "documents": 1})
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    assert prep.main(["a.txt", "--out", "o.bin", "--workers", "3"]) == 0
    monkeypatch.setenv("RAYON_NUM_THREADS", "5")
    assert prep.main(["a.txt", "--out", "o.bin", "--workers", "2"]) == 0
    assert seen == ["3", "5"]


def test_undecodable_input_is_refused_or_replaced(tmp_path, capsys):
    tok = str(tmp_path / "tok.json")
    bpe(specials=("<|endoftext|>",)).save(tok)
    (tmp_path / "latin1.txt").write_bytes("café au lait\nnaïve\n".encode("latin-1"))
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress((tmp_path / "bad.jsonl").read_bytes()))
    (tmp_path / "surrogate.jsonl").write_text('{"text": "ok"}\n{"text": "a \\ud800 b"}\n')
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([b"ok", "déjà".encode("latin-1")], pa.binary())}),
                   str(tmp_path / "bytes.parquet"))
    before = sorted(os.listdir(tmp_path))
    for name, needle in (("latin1.txt", "latin1.txt: byte 3: invalid UTF-8"),
                         ("bad.jsonl", "bad.jsonl:2: byte 28: invalid UTF-8"),
                         ("bad.jsonl.gz", "bad.jsonl.gz:2: uncompressed byte 28: invalid UTF-8"),
                         ("surrogate.jsonl", "surrogate.jsonl:2: 'text': a lone surrogate U+D800"),
                         ("bytes.parquet", "bytes.parquet: row 2: byte 1: invalid UTF-8")):
        rc, err = run([str(tmp_path / name), "--out", str(tmp_path / "o.bin"), "--tokenizer", tok], capsys)
        assert rc == 2 and len(err) == 1 and needle in err[0] and "--errors replace" in err[0], err
        assert sorted(os.listdir(tmp_path)) == before  # nothing written, not even a temporary file
    ok = write_jsonl(tmp_path / "ok.jsonl", ["fine"])
    rc, err = run([str(tmp_path / n) for n in ("latin1.txt", "bad.jsonl", "surrogate.jsonl", "bytes.parquet")] + [
        ok, "--out", str(tmp_path / "o.bin"), "--tokenizer", tok, "--errors", "replace"], capsys)
    assert rc == 0 and err == ["notice: --errors replace: undecodable input read as U+FFFD in 4 of 5 file(s)"], err
    ids, meta = tokens(str(tmp_path / "o.bin"))
    assert meta["errors"] == "replace" and meta["files_replaced"] == 4 and meta["documents"] == 8
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(tok).decode(ids, skip_special_tokens=False)
    assert text.startswith("caf\ufffd au lait\nna\ufffdve\n<|endoftext|>ok<|endoftext|>caf\ufffd<|endoftext|>")


def test_a_tokenizer_without_an_end_token_needs_eos(tmp_path, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", docs(5))
    tok = str(tmp_path / "tok.json")
    bpe(specials=("[SEP]",)).save(tok)
    out = str(tmp_path / "o.bin")
    rc, err = run([src, "--out", out, "--tokenizer", tok], capsys)
    assert rc == 2 and len(err) == 1 and "no end-of-document token" in err[0] and "pass --eos" in err[0], err
    rc, err = run([src, "--out", out, "--tokenizer", tok, "--eos", "[NOPE]"], capsys)
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: --eos '[NOPE]': "), err
    # A folder without a config is read like its tokenizer.json.
    folder = tmp_path / "f"
    folder.mkdir()
    bpe(specials=("[SEP]",)).save(str(folder / "tokenizer.json"))
    rc, err = run([src, "--out", out, "--tokenizer", str(folder)], capsys)
    assert rc == 2 and "pass --eos" in err[0]
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "f", "tok.json"]
    rc, err = run([src, "--out", out, "--tokenizer", tok, "--eos", "[SEP]"], capsys)
    ids, meta = tokens(out)
    assert rc == 0 and meta["eos_id"] == 0 and meta["bos_id"] is None and ids.count(0) == 5 and ids[-1] == 0


def test_bad_json_lines_and_parquet_columns_are_named(tmp_path, capsys):
    tok = str(tmp_path / "tok.json")
    bpe(specials=("<|endoftext|>",)).save(tok)
    cases = [('{"text": "a"}\n\n{"text": "b"\n', "x.jsonl:3: not JSON ("),
             ('{"text": "a"}\n{"body": "b"}\n', "x.jsonl:2: no key 'text' (its keys: 'body'); choose one with --text"),
             ('{"text": 3}\n', "x.jsonl:1: 'text' is a JSON number, not a string"),
             ('["text"]\n', "x.jsonl:1: a JSON array, not an object")]
    for content, needle in cases:
        (tmp_path / "x.jsonl").write_text(content)
        rc, err = run([str(tmp_path / "x.jsonl"), "--out", str(tmp_path / "o.bin"), "--tokenizer", tok], capsys)
        assert rc == 2 and len(err) == 1 and needle in err[0], (err, needle)
    gz = tmp_path / "t.jsonl.gz"
    write_jsonl(gz, docs(50), opener=gzip.open)
    gz.write_bytes(gz.read_bytes()[:-30])  # truncated
    pq_file = write_parquet(tmp_path / "p.parquet", docs(5), key="content")
    for path, needle in ((str(gz), "t.jsonl.gz: cannot read (gzip) after line"),
                         (pq_file, "p.parquet: no column 'text' (its columns: 'id', 'content')")):
        rc, err = run([path, "--out", str(tmp_path / "o.bin"), "--tokenizer", tok], capsys)
        assert rc == 2 and len(err) == 1 and needle in err[0], (err, needle)
    assert not any(n.startswith(("o.bin", ".o.bin")) for n in os.listdir(tmp_path))
    rc, err = run([pq_file, "--text-key", "content", "--out", str(tmp_path / "o.bin"), "--tokenizer", tok], capsys)
    assert rc == 0 and tokens(str(tmp_path / "o.bin"))[1]["documents"] == 5


def test_an_interrupted_run_leaves_nothing(tmp_path, monkeypatch, capsys):
    tok = str(tmp_path / "tok.json")
    bpe(specials=("<|endoftext|>",)).save(tok)
    files = corpus(tmp_path, docs(200))
    before = sorted(os.listdir(tmp_path))
    real_encode, calls = prep._encode_tasks, []

    def encode_then_interrupt(tasks, state):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_encode(tasks, state)

    monkeypatch.setattr(prep, "_encode_tasks", encode_then_interrupt)
    args = [*files, "--out", str(tmp_path / "sub" / "o.bin"), "--tokenizer", tok, "--chunk-mb", str(1 / 1024)]
    rc, err = run([*args, "--workers", "1"], capsys)
    assert rc == 130 and len(err) == 1 and err[0].startswith("error: interrupted; nothing written"), err
    assert len(calls) == 3 and sorted(os.listdir(tmp_path)) == before
    monkeypatch.setattr(prep, "_encode_tasks", real_encode)
    # With workers: the interruption arrives while the encoding thread holds tasks (here from the reader).
    real_documents = prep._documents

    def documents_then_interrupt(path, chunk, rd):
        for i, seg in enumerate(real_documents(path, chunk, rd)):
            if path.endswith(".parquet") and i == 100:
                raise KeyboardInterrupt
            yield seg

    monkeypatch.setattr(prep, "_documents", documents_then_interrupt)
    sizes = batches(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(files, str(tmp_path / "o.bin"), tokenizer=tok, chunk_mb=1 / 1024, workers=4)
    assert max(sizes) == 4 and sorted(os.listdir(tmp_path)) == before


@pytest.mark.slow
def test_sigterm_while_the_bpe_trains_on_one_long_word_ends_at_once(tmp_path):
    """One 100,000-character word keeps the BPE trainer busy for a minute (quadratic in the word); SIGTERM
    (as Ctrl-C) had waited for it to return: it now ends the run at once, exit 130, nothing left."""
    (tmp_path / "w.txt").write_text("ab" * 50_000)
    p = subprocess.Popen([sys.executable, "-m", "train.prepare", "w.txt", "--out", "w", "--vocab-size", "300",
                          "--no-progress"], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(4)  # past the imports and the reading, into the trainer
    assert p.poll() is None, p.communicate()
    sent = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and time.monotonic() - sent < 5, (p.returncode, err)
    assert err.strip().splitlines()[-1].startswith("error: interrupted; nothing written") and \
        sorted(os.listdir(tmp_path)) == ["w.txt"]


# ----------------------------------------------------------------------------- prepare's guarantees
def gap_tokenizer(path, eos=4000):
    """A word-level tokenizer of 5 tokens whose ids have gaps: the largest is ``eos``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "the": 1, "cat": 2, "sat": 7, "<|endoftext|>": eos},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return str(path)


def test_prepare_trains_a_bpe_and_round_trips(tmp_path):
    from tokenizers import Tokenizer

    from train.prepare import EOS, main

    docs = []
    for i, text in enumerate(["def f(x):\n    return x + 1\n" * 30, "class A:\n    pass\n" * 40]):
        docs.append(tmp_path / f"d{i}.py")
        docs[-1].write_text(text)
    out = tmp_path / "c.bin"
    assert main([str(d) for d in docs] + ["--out", str(out), "--vocab-size", "300"]) == 0
    meta = read_token_header(out)
    # At most the asked size (a tiny corpus runs out of pairs to merge first).
    assert meta["dtype"] == "uint16" and 257 < meta["vocab"] <= 300 and meta["documents"] == 2
    ids = np.memmap(out, dtype=np.uint16, mode="r")
    assert len(ids) == meta["tokens"] and ids.max() < meta["vocab"]
    tok = Tokenizer.from_file(str(out) + ".tokenizer.json")
    assert (tok.decode(ids.tolist(), skip_special_tokens=False)
            == docs[0].read_text() + EOS + docs[1].read_text() + EOS)  # every document ends with it
    # Fewer tokens than bytes: the BPE merged something.
    assert len(ids) < 0.8 * sum(len(d.read_bytes()) for d in docs)
    # The same BPE and ids from 40-character pieces: they end where the BPE's words do (a cut inside a newline and
    # the indentation after it counted other words, and trained other merges).
    small = tmp_path / "small.bin"
    assert main([str(d) for d in docs] + ["--out", str(small), "--vocab-size", "300", "--chunk-mb", str(40 / 2**20)]) == 0
    assert small.read_bytes() == out.read_bytes()
    assert (tmp_path / "small.bin.tokenizer.json").read_text() == (tmp_path / "c.bin.tokenizer.json").read_text()
    # Refusals: an existing output, a missing input (one line, exit 2, nothing written).
    assert main([str(docs[0]), "--out", str(out)]) == 2
    assert main([str(tmp_path / "missing.txt"), "--out", str(tmp_path / "n.bin")]) == 2
    # A vocabulary past what the BPE trainer can allocate, or one beside a given tokenizer's.
    for extra in (["--vocab-size", "5000000000"], ["--tokenizer", str(out) + ".tokenizer.json", "--vocab-size", "300"]):
        assert main([str(docs[0]), "--out", str(tmp_path / "n.bin"), *extra]) == 2
    assert not (tmp_path / "n.bin").exists()
    # A given tokenizer.json is used as is.
    out2 = tmp_path / "c2.bin"
    assert main([str(docs[1]), "--out", str(out2), "--tokenizer", str(out) + ".tokenizer.json"]) == 0
    np.testing.assert_array_equal(np.memmap(out2, dtype=np.uint16, mode="r"),
                                  np.asarray(tok.encode(docs[1].read_text()).ids + [meta["eos_id"]], np.uint16))


def test_prepare_never_replaces_or_deletes_a_file_it_did_not_create(tmp_path, capsys):
    from train.prepare import main

    doc = tmp_path / "doc.txt"
    doc.write_text("the cat sat\n" * 50)
    tok = gap_tokenizer(tmp_path / "tok.json")
    # A file of the user's under one of OUT's names (D/notes.json, ...): refused, neither replaced nor deleted.
    for mine in ("notes.json", "notes.tokenizer.json", "notes"):
        d = tmp_path / mine.replace(".", "_")
        d.mkdir()
        (d / mine).write_text("precious")
        capsys.readouterr()
        for args in ([str(doc), "--tokenizer", tok], [str(tmp_path / "missing.txt")], [str(doc), "--chunk-mb", "nan"]):
            assert main([*args, "--out", str(d / "notes")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 3 and all(line.startswith("error: ") for line in err), err
        assert err[0].startswith("error: --out ") and mine in err[0] and "exists" in err[0], err
        assert os.listdir(d) == [mine] and (d / mine).read_text() == "precious"
    # A failure after writing began (too few tokens: an empty document is its end token alone)
    # removes only what prepare wrote, folders too.
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main([str(empty), "--tokenizer", tok, "--out", str(tmp_path / "new" / "sub" / "c.bin")]) == 2
    assert "need at least 2" in capsys.readouterr().err and not (tmp_path / "new").exists()
    # An unwritable location (a folder below a file), a bad --chunk-mb or --workers: one line, exit 2.
    for args, needle in (([str(doc), "--tokenizer", tok, "--out", str(doc / "c.bin")], "cannot write in"),
                         ([str(doc), "--chunk-mb", "nan", "--out", str(tmp_path / "c.bin")], "--chunk-mb nan"),
                         ([str(doc), "--chunk-mb", "0", "--out", str(tmp_path / "c.bin")], "--chunk-mb 0"),
                         ([str(doc), "--chunk-mb", "1e15", "--out", str(tmp_path / "c.bin")], "at most 1024"),
                         ([str(doc), "--workers", "0", "--out", str(tmp_path / "c.bin")], "--workers 0")):
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert sorted(os.listdir(tmp_path)) == ["doc.txt", "empty.txt", "notes", "notes_json", "notes_tokenizer_json",
                                            "tok.json"]


def test_prepare_records_the_largest_id_and_training_refuses_ids_past_the_model(tmp_path, capfd):
    import hashlib

    from conftest import main_here
    from train.prepare import prepare

    doc = tmp_path / "doc.txt"
    doc.write_text("the cat sat\n" * 50)
    tok = gap_tokenizer(tmp_path / "tok.json")
    out = str(tmp_path / "c.bin")
    meta = prepare([str(doc), str(doc)], out, tokenizer=tok)
    # 5 tokens, the largest id 4000 (the end-of-text after each document): vocab 4001.
    assert meta["version"] == prep.VERSION and meta["vocab"] == 4001 and meta["dtype"] == "uint16"
    ids = np.memmap(out, dtype=np.uint16, mode="r")
    assert int(ids.max()) == 4000 and read_token_header(out)["vocab"] == 4001
    assert meta["tokenizer_sha256"] == hashlib.sha256(open(out + ".tokenizer.json", "rb").read()).hexdigest()
    # Training with model.vocab=256 would read token 4000 past the embedding table (NaN loss at
    # every step): refused before anything runs.
    rc, _, err = main_here(["--set", "data.source=tokens", "--set", f"data.path={out}", "--set", "model.vocab=256",
                            "--out", str(tmp_path / "run")], capfd)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("config error: model.vocab=256: ") and "4001" in err[0]
    assert not (tmp_path / "run").exists()
    # A version-1 sidecar records the token count (5): the file is read for its largest id.
    legacy = dict(meta, version=1, vocab=5)
    (tmp_path / "c.bin.json").write_text(json.dumps(legacy))
    assert read_token_header(out)["vocab"] == 4001


def test_validation_file_of_another_tokenizer_is_refused(tmp_path):
    from train.config import ConfigError, load_config
    from train.data import TokenFileSource, make_source
    from train.prepare import prepare

    doc = tmp_path / "doc.txt"
    doc.write_text("the cat sat\n" * 50)
    train_file, same, other = (str(tmp_path / n) for n in ("train.bin", "val.bin", "other.bin"))
    prepare([str(doc)], train_file, tokenizer=gap_tokenizer(tmp_path / "a.json"))
    prepare([str(doc)], same, tokenizer=gap_tokenizer(tmp_path / "b.json"))  # the same tokenizer again
    prepare([str(doc)], other, tokenizer=gap_tokenizer(tmp_path / "c.json", eos=3999))

    def val(path):
        cfg = load_config(None, ["data.source=tokens", f"data.path={train_file}", f"data.val_path={path}",
                                 "model.vocab=4096", "model.seq_len=8"])
        return make_source(cfg.data, cfg.model, split="val")

    assert len(val(same)) == len(TokenFileSource(train_file))
    with pytest.raises(ConfigError, match="not made with the tokenizer of data.path") as e:
        val(other)
    assert "\n" not in str(e.value) and "tokenizer sha256" in str(e.value)
    # The same tokenizer with another end-of-document token frames the documents otherwise.
    framed = str(tmp_path / "framed.bin")
    prepare([str(doc)], framed, tokenizer=gap_tokenizer(tmp_path / "d.json"), eos="[UNK]")
    with pytest.raises(ConfigError, match=r"its documents have eos_id \d+, those of data.path \d+"):
        val(framed)
    # A sidecar whose version is not a number this code reads: one line, not a TypeError.
    for version in ("3", None, 99):
        meta = json.loads((tmp_path / "val.bin.json").read_text())
        (tmp_path / "val.bin.json").write_text(json.dumps(dict(meta, version=version)))
        with pytest.raises(ConfigError, match=rf"sidecar version {version!r}: this code reads versions 1 to"):
            read_token_header(same)


def test_ids_are_the_tokenizers_for_each_whole_document_at_any_chunk_size(tmp_path):
    """A document longer than a piece is cut only where the tokenizer encodes both sides as the
    whole (byte-level BPE merges a newline with the indentation after it); a tokenizer that
    prefixes its input (Metaspace) gets no cut; a special token's text in a document is text."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers

    code = "".join(f"def f{i}(x):\n    return x + {i}  # <|endoftext|> or <s>\n\n" for i in range(400))
    doc = tmp_path / "code.py"
    doc.write_text(code)
    byte_bpe = tmp_path / "bpe.json"
    tok = bpe(specials=("<s>", "</s>", "<|endoftext|>"))
    tok.save(str(byte_bpe))
    meta = Tokenizer.from_file(str(byte_bpe))
    meta.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    meta.decoder = decoders.Metaspace(prepend_scheme="first")
    prefixing = tmp_path / "metaspace.json"
    meta.save(str(prefixing))
    # A BPE whose one merge is GPT-2's "\n\n" (its ids depend on where a run of newlines starts: 901 of them, from
    # an odd offset, cross the 300-character cuts far from their start); its end token added as a plain token.
    # Likewise with "  " and "\n " merged, whose post-processor trims whitespace from the tokens' offsets.
    from tokenizers import models, processors
    alphabet = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    pairs = Tokenizer(models.BPE(vocab={**alphabet, "ĊĊ": 256}, merges=[("Ċ", "Ċ")]))
    pairs.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    pairs.add_tokens(["<|endoftext|>"])
    newlines = tmp_path / "newlines.json"
    pairs.save(str(newlines))
    runs = tmp_path / "runs.txt"
    runs.write_text(("a" * 11 + "\n" * 901 + "b <|endoftext|>\n" * 30) * 3)
    trims = Tokenizer(models.BPE(vocab={**alphabet, "ĊĊ": 256, "ĠĠ": 257, "ĊĠ": 258},
                                 merges=[("Ċ", "Ċ"), ("Ċ", "Ġ"), ("Ġ", "Ġ")]))
    trims.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trims.post_processor = processors.ByteLevel(trim_offsets=True)
    trims.add_special_tokens(["<|endoftext|>"])
    trimming = tmp_path / "trimming.json"
    trims.save(str(trimming))
    blanks = tmp_path / "blanks.txt"
    blanks.write_text(("x" + "\n" * 401 + " " * 299 + "b c\n" * 100) * 2)
    for tokenizer, path in ((byte_bpe, doc), (prefixing, doc), (newlines, runs), (trimming, blanks)):
        text = path.read_text()
        whole = Tokenizer.from_file(str(tokenizer))
        eos = whole.token_to_id("<|endoftext|>")
        whole.add_special_tokens([AddedToken("<|endoftext|>", special=True)])  # its text in a document is text
        whole.encode_special_tokens = True
        want = whole.encode(text, add_special_tokens=False).ids + [eos]
        for chunk_mb in (1, 300 / 2**20, 40 / 2**20):
            out = str(tmp_path / f"{tokenizer.stem}-{len(os.listdir(tmp_path))}.bin")
            prep.prepare([str(path)], out, tokenizer=str(tokenizer), chunk_mb=chunk_mb, workers=1)
            ids = np.fromfile(out, dtype=read_token_header(out)["dtype"]).tolist()
            assert ids == want, (tokenizer.stem, chunk_mb)
        assert want.count(eos) == 1 and "<s>" not in [whole.id_to_token(i) for i in want]


def test_a_gzipped_text_file_reads_as_its_text(tmp_path, capsys):
    """``x.txt.gz`` is one document, its uncompressed text (it had been refused as invalid UTF-8, or with
    --errors replace tokenized as compressed bytes); a truncated one is named, exit 2."""
    tok = str(tmp_path / "tok.json")
    bpe().save(tok)
    text = "".join(docs(40))
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(text.encode()))
    ids = []
    for name in ("a.txt", "a.txt.gz"):
        out = str(tmp_path / f"{name}.bin")
        prep.prepare([str(tmp_path / name)], out, tokenizer=tok, eos="</s>", workers=1, chunk_mb=300 / 2**20)
        ids.append(np.fromfile(out, dtype=np.uint16).tolist())
    assert ids[0] == ids[1] and len(ids[0]) > 100
    (tmp_path / "cut.txt.gz").write_bytes(gzip.compress(text.encode())[:-20])
    rc, err = run([str(tmp_path / "cut.txt.gz"), "--tokenizer", tok, "--eos", "</s>", "--out", str(tmp_path / "cut.bin")],
                  capsys)
    assert rc == 2 and len(err) == 1 and "cut.txt.gz: cannot read (gzip) after uncompressed byte" in err[0], err


def test_a_whitespace_run_longer_than_the_cut_context_is_never_cut_after(tmp_path):
    """300 spaces before a newline are one word with it at the end of a piece (GPT-2's \\s+(?!\\S)), two in the
    whole document: a cut there changed the ids where the tokenizer merges the whole run (one learnt from it), and
    the words the BPE trainer counts. Both now match the whole document's at any chunk size."""
    from tokenizers import Tokenizer

    (tmp_path / "run.jsonl").write_text(json.dumps({"text": "x" + " " * 300 + "\n"}) + "\n")
    prep.prepare([str(tmp_path / "run.jsonl")], str(tmp_path / "tok"), vocab_size=300, workers=1)
    chunk = 1000
    head = "hello world\n" * ((chunk - 400) // 12)
    text = head + "w" * (chunk - 200 - len(head)) + " " * 300 + "\n" + "next line\n" * 100
    (tmp_path / "big.txt").write_text(text)
    tok = Tokenizer.from_file(str(tmp_path / "tok.tokenizer.json"))
    want = tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("<|endoftext|>")]
    trained = set()
    for chunk_mb in (chunk / 2**20, 1):
        out = str(tmp_path / f"ids-{chunk_mb}")
        prep.prepare([str(tmp_path / "big.txt")], out, tokenizer=str(tmp_path / "tok.tokenizer.json"),
                     chunk_mb=chunk_mb, workers=1)
        assert np.fromfile(out, dtype=np.uint16).tolist() == want, chunk_mb
        out = str(tmp_path / f"bpe-{chunk_mb}")
        prep.prepare([str(tmp_path / "big.txt")], out, vocab_size=400, chunk_mb=chunk_mb, workers=1)
        trained.add((open(out + ".tokenizer.json").read(), open(out, "rb").read()))
    assert len(trained) == 1


def test_a_byte_order_mark_and_a_categorical_parquet_column_read_as_their_text(tmp_path):
    """A text file's UTF-8 byte order mark is not text (as in JSON Lines); a dictionary-encoded
    (categorical) Parquet string column reads as its strings."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = tmp_path / "tok.json"
    bpe().save(str(tok))
    texts = docs(40)
    pq.write_table(pa.table({"text": pa.array(texts)}), str(tmp_path / "plain.parquet"))
    pq.write_table(pa.table({"text": pa.array(texts).dictionary_encode()}), str(tmp_path / "coded.parquet"))
    (tmp_path / "plain.txt").write_text(texts[0], encoding="utf-8")
    (tmp_path / "bom.txt").write_text(texts[0], encoding="utf-8-sig")
    ids = {}
    for name, chunk_mb in (("plain.parquet", 1), ("coded.parquet", 1), ("plain.txt", 1), ("bom.txt", 1),
                           ("bom.txt", 2 / 2**20)):  # read 2 bytes at a time: the mark spans two reads
        out = str(tmp_path / f"{name}-{chunk_mb}.bin")
        prep.prepare([str(tmp_path / name)], out, tokenizer=str(tok), eos="</s>", workers=1, chunk_mb=chunk_mb)
        ids[name, chunk_mb] = np.fromfile(out, dtype=np.uint16).tolist()
    assert ids["coded.parquet", 1] == ids["plain.parquet", 1]
    assert ids["bom.txt", 1] == ids["bom.txt", 2 / 2**20] == ids["plain.txt", 1]
