//! The GGUF reader and writer: what the writer puts in comes back out of
//! the reader, tensor data lands at aligned offsets, and malformed headers
//! are rejected with the file named. (Real llama.cpp files are read by the
//! control vector tests and the SmolLM2 import.)

mod common;

use common::checkpoint::{Scratch, temp_dir};
use wgspark::Error;
use wgspark::gguf::{GgmlType, Gguf, GgufWriter, Meta, MetaValue};
use wgspark::tokenizer::TextStream;

#[test]
fn writer_and_reader_round_trip() {
    let path = temp_dir("gguf_round_trip").file("t.gguf");
    let a: Vec<f32> = (0..70).map(|i| i as f32 * 0.5 - 3.0).collect();
    let b: Vec<f32> = (0..6).map(|i| -(i as f32)).collect();
    let h: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
    GgufWriter::new()
        .meta("general.architecture", MetaValue::Str("test".into()))
        .meta("u32", MetaValue::U32(7))
        .meta("i32", MetaValue::I32(-7))
        .meta("u64", MetaValue::U64(1 << 40))
        .meta("f32", MetaValue::F32(0.25))
        .meta("bool", MetaValue::Bool(true))
        .tensor_f32("a", &[70], &a)
        .tensor_f32("b", &[3, 2], &b)
        .tensor_bytes("h", &[2], GgmlType::F16, h)
        .write(&path)
        .unwrap();
    let g = Gguf::open(&path).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.meta_str("general.architecture").unwrap(), "test");
    assert_eq!(g.metadata["u32"], Meta::Int(7));
    assert_eq!(g.metadata["i32"], Meta::Int(-7));
    assert_eq!(g.metadata["u64"], Meta::Int(1 << 40));
    assert_eq!(g.metadata["f32"], Meta::Float(0.25));
    assert_eq!(g.metadata["bool"], Meta::Bool(true));
    let names: Vec<&str> = g.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "b", "h"]);
    let tb = g.tensor("b").unwrap();
    assert_eq!(
        (tb.dims.clone(), tb.shape(), tb.ty, tb.elements()),
        (vec![3, 2], vec![2, 3], GgmlType::F32, 6)
    );
    assert_eq!(g.dequantize(g.tensor("a").unwrap()).unwrap(), a);
    assert_eq!(g.dequantize(tb).unwrap(), b);
    assert_eq!(g.dequantize(g.tensor("h").unwrap()).unwrap(), [1.5, -2.0]);
    // Every tensor's data starts on the default 32-byte alignment.
    let bytes = std::fs::read(&path).unwrap();
    for t in &g.tensors {
        let data = g.data(t);
        let offset = data.as_ptr() as usize - g.data(&g.tensors[0]).as_ptr() as usize;
        assert_eq!(offset % 32, 0, "{}", t.name);
        assert!(bytes.windows(data.len()).any(|w| w == data));
    }
}

#[test]
fn malformed_headers_are_rejected_with_the_file_named() {
    let dir = temp_dir("gguf_malformed");
    let valid = GgufWriter::new().meta("k", MetaValue::U32(1)).tensor_f32("t", &[4], &[1.0; 4]).to_bytes();
    let mut bad_version = valid.clone();
    bad_version[4] = 9;
    let mut big_endian = valid.clone();
    big_endian[4..8].copy_from_slice(&3u32.to_be_bytes());
    let mut bad_type = valid.clone();
    // The tensor's type id follows its name ("t"), dim count (1) and dim (4).
    let before_type = [&1u64.to_le_bytes()[..], b"t", &1u32.to_le_bytes(), &4u64.to_le_bytes()].concat();
    let type_at =
        valid.windows(before_type.len()).position(|w| w == before_type).unwrap() + before_type.len();
    bad_type[type_at] = 99;
    let mut ternary = bad_type.clone();
    ternary[type_at] = 34;
    let mut duplicate_key = GgufWriter::new();
    duplicate_key.meta("k", MetaValue::U32(1)).meta("k", MetaValue::U32(2));
    let duplicate_tensor =
        GgufWriter::new().tensor_f32("t", &[4], &[1.0; 4]).tensor_f32("t", &[4], &[2.0; 4]).to_bytes();
    // Key "k" holding an array of an array of ... 40 000 deep (each one
    // element), which a reader recursing without bound overflows its stack on.
    let depth = 40_000;
    let mut nested = [&b"GGUF"[..], &3u32.to_le_bytes(), &0u64.to_le_bytes(), &1u64.to_le_bytes()].concat();
    nested.extend([&1u64.to_le_bytes()[..], b"k", &9u32.to_le_bytes()].concat());
    for _ in 0..depth {
        nested.extend([&9u32.to_le_bytes()[..], &1u64.to_le_bytes()].concat());
    }
    nested.extend([&4u32.to_le_bytes()[..], &0u64.to_le_bytes(), &7u32.to_le_bytes()].concat());
    for (name, bytes, needle) in [
        ("bad_magic", b"GGUX....".to_vec(), "bad magic"),
        ("bad_version", bad_version, "version 9"),
        ("big_endian", big_endian, "big-endian GGUF"),
        ("unknown_type", bad_type, "unsupported ggml type 99 (an unknown type)"),
        ("ternary", ternary, "tensor t: unsupported ggml type 34 (TQ1_0)"),
        ("duplicate_key", duplicate_key.to_bytes(), "appears twice"),
        ("duplicate_tensor", duplicate_tensor, "tensor t appears twice"),
        ("nested_arrays", nested, "nested more than"),
        ("truncated", valid[..valid.len() - 3].to_vec(), "truncated"),
    ] {
        let path = dir.join(format!("{name}.gguf"));
        std::fs::write(&path, bytes).unwrap();
        match Gguf::open(&path) {
            Err(Error::Gguf { path: p, message }) => {
                assert_eq!(p, path);
                assert!(message.contains(needle), "{name}: {message}");
            }
            Err(other) => panic!("{name}: {other}"),
            Ok(_) => panic!("{name}: opened"),
        }
    }
    // A u64 past 2^63 is read as the number it is, not a negative integer.
    let path = dir.join("u64_past_i64.gguf");
    GgufWriter::new().meta("llama.block_count", MetaValue::U64(1 << 63)).write(&path).unwrap();
    let err = Gguf::open(&path).unwrap().meta_int("llama.block_count").unwrap_err();
    assert!(
        err.to_string().contains("is 92233720368547") && err.to_string().contains("expected an integer"),
        "{err}"
    );
}

/// A copy of a GGUF model fixture with its metadata and tensors edited:
/// `meta` may change or drop (None) values, `tensor` may replace a tensor's
/// dims, type and bytes.
fn edited_model(
    name: &str,
    meta: impl Fn(&str, &Meta) -> Option<MetaValue>,
    tensor: impl Fn(&str) -> Option<(Vec<usize>, GgmlType, Vec<u8>)>,
) -> Scratch {
    edited_fixture("gguf_qwen3_q4_0", name, meta, tensor)
}

/// A copy of fixture `source`'s model.gguf, its metadata and tensors passed
/// through `meta` and `tensor` (None drops a key, keeps a tensor).
fn edited_fixture(
    source: &str,
    name: &str,
    meta: impl Fn(&str, &Meta) -> Option<MetaValue>,
    tensor: impl Fn(&str) -> Option<(Vec<usize>, GgmlType, Vec<u8>)>,
) -> Scratch {
    rewritten_fixture(source, name, meta, Vec::new(), |t, bytes| {
        let (dims, ty, bytes) = tensor(&t.name).unwrap_or((t.dims.clone(), t.ty, bytes.to_vec()));
        vec![(t.name.clone(), dims, ty, bytes)]
    })
}

/// A tensor as the writer takes it: name, dims, type and bytes.
type WrittenTensor = (String, Vec<usize>, GgmlType, Vec<u8>);

/// A copy of fixture `source`'s model.gguf written to a folder of its own:
/// its metadata through `meta` (None drops a key), then `extra` keys, and in
/// place of each tensor (with its bytes) the tensors `tensors` gives.
fn rewritten_fixture(
    source: &str,
    name: &str,
    meta: impl Fn(&str, &Meta) -> Option<MetaValue>,
    extra: Vec<(&str, MetaValue)>,
    tensors: impl Fn(&wgspark::gguf::TensorInfo, &[u8]) -> Vec<WrittenTensor>,
) -> Scratch {
    let source = Gguf::open(common::checkpoint::fixture_dir(source).join("model.gguf")).unwrap();
    let mut w = GgufWriter::new();
    let mut keys: Vec<&String> = source.metadata.keys().collect();
    keys.sort();
    for key in keys {
        if let Some(value) = meta(key, &source.metadata[key]) {
            w.meta(key, value);
        }
    }
    for (key, value) in extra {
        w.meta(key, value);
    }
    for t in &source.tensors {
        for (name, dims, ty, bytes) in tensors(t, source.data(t)) {
            w.tensor_bytes(&name, &dims, ty, bytes);
        }
    }
    let path = temp_dir(name).file("model.gguf");
    w.write(&path).unwrap();
    path
}

fn same(_: &str, value: &Meta) -> Option<MetaValue> {
    Some(match value {
        Meta::Int(v) => MetaValue::U32(*v as u32),
        Meta::Float(v) => MetaValue::F32(*v as f32),
        Meta::Bool(v) => MetaValue::Bool(*v),
        Meta::Str(v) => MetaValue::Str(v.clone()),
        Meta::Array(_) => panic!("the fixture has no array metadata"),
    })
}

/// A GGUF model that cannot be loaded is a typed error naming what is wrong.
#[test]
fn bad_gguf_models_are_typed_errors() {
    let gpu = common::gpu(common::backends()[0]);
    let load = |path: &std::path::Path| wgspark::Model::load(path, &gpu).map(|_| ()).unwrap_err();

    let copy = edited_model("gguf_copy", same, |_| None);
    wgspark::Model::load(&copy, &gpu).expect("an unedited copy loads");

    let truncated = temp_dir("gguf_truncated").file("model.gguf");
    let bytes = std::fs::read(&copy).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() - 1000]).unwrap();
    let err = load(&truncated);
    assert!(matches!(&err, Error::Gguf { message, .. } if message.contains("truncated")), "{err}");

    let arch = edited_model(
        "gguf_arch",
        |k, v| if k == "general.architecture" { Some(MetaValue::Str("gptneox".into())) } else { same(k, v) },
        |_| None,
    );
    let err = load(&arch);
    assert!(
        matches!(&err, Error::UnsupportedArchitecture { model_type, .. } if model_type.contains("gptneox")),
        "{err}"
    );

    let missing = edited_model(
        "gguf_missing_key",
        |k, v| (k != "qwen3.block_count").then(|| same(k, v)).flatten(),
        |_| None,
    );
    let err = load(&missing);
    assert!(err.to_string().contains("qwen3.block_count"), "names the key: {err}");

    // 96 elements are three Q4_0 blocks, but rows of 48 are not whole blocks.
    let ragged = edited_model("gguf_ragged", same, |name| {
        (name == "blk.0.attn_norm.weight").then(|| (vec![48, 2], GgmlType::Q4_0, vec![0u8; 3 * 18]))
    });
    let err = load(&ragged);
    assert!(
        matches!(&err, Error::Gguf { message, .. } if message.contains("not whole Q4_0 blocks")),
        "{err}"
    );

    // A weight in a type no kernel reads.
    let q_rows = 4 * 64;
    let odd_type = edited_model("gguf_odd_type", same, |name| {
        (name == "blk.1.attn_q.weight")
            .then(|| (vec![256, q_rows], GgmlType::Q8_1, vec![0u8; q_rows * 8 * 36]))
    });
    let err = load(&odd_type);
    assert!(
        matches!(&err, Error::Unsupported { value, .. } if value.contains("blk.1.attn_q.weight") && value.contains("Q8_1")),
        "{err}"
    );

    // A megabyte of string where a number belongs: named, not quoted whole.
    let huge = edited_model(
        "gguf_huge_value",
        |k, v| if k == "qwen3.block_count" { Some(MetaValue::Str("9".repeat(1 << 20))) } else { same(k, v) },
        |_| None,
    );
    let message = load(&huge).to_string();
    assert!(message.contains("qwen3.block_count") && message.len() < 1000, "{} bytes", message.len());

    // A router gating function llama.cpp does not define.
    let gating_key = "minimax-m2.expert_gating_func";
    let gating = edited_fixture(
        "gguf_minimax_m2_q4_k_m",
        "gguf_gating",
        |k, v| if k == gating_key { Some(MetaValue::U32(7)) } else { same(k, v) },
        |_| None,
    );
    let err = load(&gating);
    assert!(err.to_string().contains("expert_gating_func 7"), "{err}");
}

/// A split set (gguf-py's writer, as llama.cpp's converter splits) loads
/// from its folder or from any of its parts; a missing part is an error
/// naming its file, and parts out of place (their `split.no`) or beside
/// another model are errors too.
#[test]
fn split_gguf_sets_load_whole_or_are_typed_errors() {
    let gpu = common::gpu(common::backends()[0]);
    let load = |path: &std::path::Path| wgspark::Model::load(path, &gpu).map(|m| m.config.layers);
    let fixture = common::checkpoint::fixture_dir("gguf_llama_q2_k_split");
    let part = |dir: &std::path::Path, i: usize| dir.join(format!("model-0000{i}-of-00004.gguf"));
    let copy = |name: &str| {
        let dir = temp_dir(name);
        for i in 1..=4 {
            std::fs::copy(part(&fixture, i), part(&dir, i)).unwrap();
        }
        dir
    };
    assert_eq!(load(&fixture).unwrap(), 2);
    assert_eq!(load(&part(&fixture, 3)).unwrap(), 2, "from its third part");

    let missing = copy("gguf_split_missing");
    std::fs::remove_file(part(&missing, 3)).unwrap();
    let err = load(&missing).unwrap_err();
    assert!(err.to_string().contains("model-00003-of-00004.gguf"), "{err}");

    let swapped = copy("gguf_split_swapped");
    std::fs::rename(part(&swapped, 2), swapped.join("x.tmp")).unwrap();
    std::fs::rename(part(&swapped, 3), part(&swapped, 2)).unwrap();
    std::fs::rename(swapped.join("x.tmp"), part(&swapped, 3)).unwrap();
    let err = load(&swapped).unwrap_err();
    assert!(err.to_string().contains("split.no 2 and split.count 4, where part 2 of 4"), "{err}");

    // A name promising more parts than any set has is a file of its own.
    let promising =
        temp_dir("gguf_split_promising").file("model-00000000000000000001-of-18446744073709551615.gguf");
    std::fs::copy(common::checkpoint::fixture_dir("gguf_llama_q2_k").join("model.gguf"), &promising).unwrap();
    assert_eq!(load(&promising).unwrap(), 2);

    let beside = copy("gguf_split_beside");
    std::fs::copy(
        common::checkpoint::fixture_dir("gguf_llama_q2_k").join("model.gguf"),
        beside.join("other.gguf"),
    )
    .unwrap();
    let err = load(&beside).unwrap_err();
    assert!(err.to_string().contains("several GGUF models"), "{err}");
}

/// llama.cpp's files from before April 2024 (Mixtral's as most were
/// published) hold one tensor per expert (`blk.N.ffn_gate.E.weight`) where
/// later ones stack them (`blk.N.ffn_gate_exps.weight`): the Mixtral
/// fixture rewritten so gives the same logits.
#[test]
fn gguf_experts_one_tensor_each_load_as_stacked_ones() {
    let gpu = common::gpu(common::backends()[0]);
    let fixture = common::checkpoint::fixture_dir("gguf_mixtral_q5_1");
    let per_expert = std::cell::Cell::new(0);
    let path =
        rewritten_fixture("gguf_mixtral_q5_1", "gguf_per_expert", same, Vec::new(), |t, bytes| {
            match t.name.strip_suffix("_exps.weight") {
                Some(stem) => {
                    let (experts, each) = (t.dims[2], bytes.len() / t.dims[2]);
                    per_expert.set(per_expert.get() + experts);
                    (0..experts)
                        .map(|e| {
                            let slice = bytes[e * each..(e + 1) * each].to_vec();
                            (format!("{stem}.{e}.weight"), t.dims[..2].to_vec(), t.ty, slice)
                        })
                        .collect()
                }
                None => vec![(t.name.clone(), t.dims.clone(), t.ty, bytes.to_vec())],
            }
        });
    assert!(per_expert.get() > 0, "the fixture stacks its experts");
    let expected =
        common::fixtures::cases().into_iter().find(|c| c.name == "gguf_mixtral_q5_1").unwrap().expected;
    let stacked =
        common::fixtures::replay(&wgspark::Model::load(&fixture, &gpu).unwrap(), &expected).unwrap();
    let separate = common::fixtures::replay(&wgspark::Model::load(&path, &gpu).unwrap(), &expected).unwrap();
    assert_eq!(stacked, separate);
}

/// Mistral Small 3.1 and later as llama.cpp's converter writes them now
/// (architecture `mistral3`: Llama's keys, tensors and q/k interleaving
/// under that name) give a Llama file's logits; Ministral 3's attention
/// temperature, which the attention does not apply, is refused by name.
#[test]
fn mistral3_gguf_models_load_as_llama_ones() {
    let gpu = common::gpu(common::backends()[0]);
    let source = "gguf_llama_q4_k_m";
    let source_meta =
        Gguf::open(common::checkpoint::fixture_dir(source).join("model.gguf")).unwrap().metadata;
    let renamed: Vec<(String, MetaValue)> = source_meta
        .iter()
        .filter_map(|(k, v)| Some((format!("mistral3.{}", k.strip_prefix("llama.")?), same(k, v)?)))
        .collect();
    assert!(renamed.len() > 5, "the fixture has llama keys");
    let mistral3 = |name: &str, extra: &[(&str, MetaValue)]| {
        let keys =
            renamed.iter().map(|(k, v)| (k.as_str(), v.clone())).chain(extra.iter().cloned()).collect();
        let meta = |k: &str, v: &Meta| match k {
            "general.architecture" => Some(MetaValue::Str("mistral3".into())),
            _ if k.starts_with("llama.") => None,
            _ => same(k, v),
        };
        rewritten_fixture(source, name, meta, keys, |t, bytes| {
            vec![(t.name.clone(), t.dims.clone(), t.ty, bytes.to_vec())]
        })
    };
    let expected = common::fixtures::cases().into_iter().find(|c| c.name == source).unwrap().expected;
    let replay = |path: &std::path::Path| {
        common::fixtures::replay(&wgspark::Model::load(path, &gpu).unwrap(), &expected).unwrap()
    };
    let llama = replay(&common::checkpoint::fixture_dir(source));
    assert_eq!(replay(&mistral3("gguf_mistral3", &[])), llama);

    let key = "mistral3.attention.temperature_scale";
    let path = mistral3("gguf_mistral3_temperature", &[(key, MetaValue::F32(0.1))]);
    let err = wgspark::Model::load(&path, &gpu).map(|_| ()).unwrap_err();
    assert!(err.to_string().contains(key), "{err}");
}

/// Generation ends where llama.cpp ends it: at the file's end of sequence,
/// and at its end of a turn and of a message where it names them.
#[test]
fn gguf_end_of_turn_and_message_ids_end_generation() {
    let gpu = common::gpu(common::backends()[0]);
    let extra = vec![
        ("tokenizer.ggml.eos_token_id", MetaValue::U32(1)),
        ("tokenizer.ggml.eot_token_id", MetaValue::U32(7)),
        ("tokenizer.ggml.eom_token_id", MetaValue::U32(1)),
    ];
    let path = rewritten_fixture("gguf_qwen3_q4_0", "gguf_end_ids", same, extra, |t, bytes| {
        vec![(t.name.clone(), t.dims.clone(), t.ty, bytes.to_vec())]
    });
    assert_eq!(wgspark::Model::load(&path, &gpu).unwrap().config.eos_token_ids, [1, 7]);
}

#[derive(serde::Deserialize)]
struct SpmCase {
    text: String,
    ids: Vec<u32>,
    decoded: String,
}

#[derive(serde::Deserialize)]
struct SpmExpected {
    bos_id: u32,
    cases: Vec<SpmCase>,
}

/// A `llama` (SentencePiece BPE) tokenizer stored as llama.cpp stores one,
/// without merges, encodes every text to the ids SentencePiece gives it
/// (byte fallback, runs of spaces, digits and the dummy prefix included),
/// puts BOS first when asked for special tokens, reads control tokens
/// written as text as tokens, and decodes back as SentencePiece does
/// (scripts/make_spm_fixture.py).
#[test]
fn sentencepiece_gguf_tokenizer_encodes_as_sentencepiece_does() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tokenizers");
    let expected: SpmExpected =
        serde_json::from_str(&std::fs::read_to_string(format!("{dir}/spm.json")).unwrap()).unwrap();
    let gguf = Gguf::open(format!("{dir}/spm.gguf")).unwrap();
    let tokenizer = wgspark::tokenizer::from_gguf(&gguf).unwrap().expect("a llama tokenizer is built");
    for case in &expected.cases {
        let ids = tokenizer.encode(&case.text).unwrap();
        assert_eq!(ids, case.ids, "{:?}", case.text);
        let with_bos = tokenizer.encode_prompt(&case.text).unwrap();
        assert_eq!(with_bos, [&[expected.bos_id][..], &case.ids].concat(), "{:?} with BOS", case.text);
        assert_eq!(tokenizer.decode(&case.ids, true).unwrap(), case.decoded, "{:?} decoded", case.text);
    }
    // Chat templates write control tokens as text: they are read as tokens.
    let bos = tokenizer.encode("<s>").unwrap();
    assert_eq!(bos, [expected.bos_id]);
}

/// Generated text streamed id by id is the text of all the ids decoded
/// whole, given out in pieces that never end inside a character (the
/// fixture's byte-fallback ids split 日本語 and 🙂 into bytes), with the
/// SentencePiece decoder's leading space kept where a piece starts and
/// where the text continues a prompt.
#[test]
fn streamed_text_is_the_whole_decode_in_whole_characters() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tokenizers");
    let expected: SpmExpected =
        serde_json::from_str(&std::fs::read_to_string(format!("{dir}/spm.json")).unwrap()).unwrap();
    let tokenizer =
        wgspark::tokenizer::from_gguf(&Gguf::open(format!("{dir}/spm.gguf")).unwrap()).unwrap().unwrap();
    let all_ids: Vec<u32> = expected.cases.iter().flat_map(|c| c.ids.iter().copied()).collect();
    // A lone first byte of 日 (an unfinished character) mid-text and at the end.
    let unfinished = [vec![233, 362], vec![362, 233]];
    let cases = expected
        .cases
        .iter()
        .map(|c| [&[expected.bos_id][..], &c.ids].concat())
        .chain([all_ids])
        .chain(unfinished);
    for ids in cases {
        for skip_special in [false, true] {
            let mut stream = TextStream::new(&tokenizer, skip_special);
            let mut text = String::new();
            for &id in &ids {
                let piece = stream.push(id).unwrap();
                assert!(!piece.ends_with(char::REPLACEMENT_CHARACTER), "{ids:?}: piece {piece:?}");
                text.push_str(&piece);
            }
            text.push_str(&stream.finish().unwrap());
            assert_eq!(
                text,
                tokenizer.decode(&ids, skip_special).unwrap(),
                "{ids:?} (skip special: {skip_special})"
            );
        }
    }
    // Text that continues a prompt, cut after each of its ids: the prompt's
    // text and the continuation's pieces are the whole text ("is" + " Paris",
    // the space a decode of the continuation alone drops).
    for case in &expected.cases {
        let ids = [&[expected.bos_id][..], &case.ids].concat();
        for cut in 1..ids.len() {
            let (prompt, continuation) = ids.split_at(cut);
            let mut stream = TextStream::after(&tokenizer, false, prompt);
            let mut text = tokenizer.decode(prompt, false).unwrap();
            if text.ends_with(char::REPLACEMENT_CHARACTER) {
                continue; // no typed prompt ends inside a character
            }
            for &id in continuation {
                text.push_str(&stream.push(id).unwrap());
            }
            text.push_str(&stream.finish().unwrap());
            assert_eq!(text, tokenizer.decode(&ids, false).unwrap(), "{prompt:?} then {continuation:?}");
        }
    }
}

/// A byte-level BPE vocabulary (`tokenizer.ggml.model` = gpt2) splits text
/// as its `tokenizer.ggml.pre` names before merging: GPT-2's regex keeps a
/// number whole, Llama 3's (`llama-bpe`) cuts it into runs of three digits,
/// takes a word of the vocabulary whole and puts BOS first, Qwen2's cuts
/// it into single digits, MiniMax-M2's (GPT-4o's) into runs of three,
/// Mistral's tekken (also named pixtral) into single digits, taking a word
/// whole and putting BOS first, DeepSeek LLM's keeps a number whole and parts letters from
/// punctuation, DeepSeek Coder's cuts digits one by one; a name it does not
/// know is an error.
#[test]
fn byte_level_gguf_tokenizers_split_as_their_pre_tokenizer_names() {
    let tokens = ["1", "2", "3", "4", "5", "12", "34", "123", "45", "a", "b", "c", "abc", "<bos>", "[", "a["];
    let merges = ["3 4", "1 2", "12 3", "4 5", "a ["];
    let build = |pre: Option<&str>| {
        let mut w = GgufWriter::new();
        w.meta("general.architecture", MetaValue::Str("llama".into()));
        w.meta("tokenizer.ggml.model", MetaValue::Str("gpt2".into()));
        w.meta("tokenizer.ggml.tokens", MetaValue::Strings(tokens.map(String::from).to_vec()));
        w.meta("tokenizer.ggml.merges", MetaValue::Strings(merges.map(String::from).to_vec()));
        w.meta("tokenizer.ggml.bos_token_id", MetaValue::U32(13));
        if let Some(pre) = pre {
            w.meta("tokenizer.ggml.pre", MetaValue::Str(pre.into()));
        }
        let path = temp_dir("pre_tokenizer").file("tokenizer.gguf");
        w.write(&path).unwrap();
        wgspark::tokenizer::from_gguf(&Gguf::open(&path).unwrap())
    };
    let id = |t: &str| tokens.iter().position(|x| *x == t).unwrap() as u32;
    let encode = |pre: Option<&str>, text: &str, special: bool| {
        let tokenizer = build(pre).unwrap().expect("a gpt2 tokenizer is built");
        if special { tokenizer.encode_prompt(text) } else { tokenizer.encode(text) }.unwrap()
    };
    for pre in [None, Some("default"), Some("gpt2")] {
        assert_eq!(encode(pre, "12345", true), [id("12"), id("34"), id("5")], "{pre:?}");
        assert_eq!(encode(pre, "abc", false), ["a", "b", "c"].map(id), "{pre:?}");
    }
    assert_eq!(encode(Some("llama-bpe"), "12345", false), [id("123"), id("45")]);
    assert_eq!(encode(Some("llama-bpe"), "12345", true), [id("<bos>"), id("123"), id("45")]);
    assert_eq!(encode(Some("llama-bpe"), "abc", false), [id("abc")]);
    assert_eq!(encode(Some("qwen2"), "12345", true), ["1", "2", "3", "4", "5"].map(id));
    assert_eq!(encode(Some("qwen2"), "abc", false), ["a", "b", "c"].map(id));
    assert_eq!(encode(Some("deepseek-r1-qwen"), "12345", true), ["1", "2", "3", "4", "5"].map(id));
    // MiniMax-M2's (GPT-4o's): runs of three digits, merges as they come.
    assert_eq!(encode(Some("minimax-m2"), "12345", false), [id("123"), id("45")]);
    assert_eq!(encode(Some("minimax-m2"), "abc", false), ["a", "b", "c"].map(id));
    assert_eq!(encode(Some("tekken"), "12345", true), ["<bos>", "1", "2", "3", "4", "5"].map(id));
    assert_eq!(encode(Some("tekken"), "abc", false), [id("abc")]);
    assert_eq!(encode(Some("pixtral"), "12345abc", true), ["<bos>", "1", "2", "3", "4", "5", "abc"].map(id));
    assert_eq!(encode(Some("falcon3"), "12345", true), [id("<bos>"), id("123"), id("45")]);
    assert_eq!(encode(Some("smaug-bpe"), "12345", true), [id("123"), id("45")]);
    assert_eq!(encode(Some("smaug-bpe"), "abc", false), ["a", "b", "c"].map(id));
    // Its letter class (with such code points as U+1FD3 and the Kelvin sign
    // U+212A, which text normalization would turn into an empty or an
    // ASCII-wide range) leaves "[" out: "a[" is not merged.
    assert_eq!(encode(Some("deepseek-llm"), "12345a[", false), ["12", "34", "5", "a", "["].map(id));
    assert_eq!(encode(Some("deepseek-coder"), "12345a[", false), ["1", "2", "3", "4", "5", "a", "["].map(id));
    let err = build(Some("tekken-unknown")).unwrap_err();
    assert!(err.to_string().contains("tekken-unknown"), "{err}");
    // A string twice in the vocabulary is named with both ids.
    let mut w = GgufWriter::new();
    w.meta("tokenizer.ggml.model", MetaValue::Str("gpt2".into()));
    w.meta("tokenizer.ggml.tokens", MetaValue::Strings(["a", "b", "a"].map(String::from).to_vec()));
    w.meta("tokenizer.ggml.merges", MetaValue::Strings(vec![]));
    let path = temp_dir("pre_tokenizer").file("duplicate.gguf");
    w.write(&path).unwrap();
    let err = wgspark::tokenizer::from_gguf(&Gguf::open(&path).unwrap()).unwrap_err();
    assert!(err.to_string().contains("\"a\" appears at ids 0 and 2"), "{err}");
}

/// llama-quantize's Q4_K_M gives some layers' value rows another format
/// (Q6_K) than their queries' and keys' (Q4_K): those rows load as a part
/// of their own, which the flow writes apart from the q/k rows; the
/// others share one part with them. (The conformance test checks the
/// logits such a file gives.)
#[test]
fn value_rows_in_their_own_format_are_written_apart() {
    let gpu = common::gpu(common::backends()[0]);
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gguf_llama_q4_k_m/model.gguf");
    let model = wgspark::Model::load(std::path::Path::new(path), &gpu).unwrap();
    let heads = model.config.heads;
    let apart: Vec<bool> = model
        .weights()
        .layers
        .iter()
        .map(|l| wgspark::flow::first_value_row_apart(&l.qkv, heads).is_some())
        .collect();
    assert_eq!(apart, [false, true], "layer 0's value rows are Q4_K, layer 1's Q6_K");
    let v_part = model.weights().layers[1].qkv.parts.last().unwrap();
    assert_eq!(v_part.first_row, (heads.q + heads.kv) * heads.dim);
}

/// A mixed file whose dense layers hold gate (Q5_K) and up (IQ4_NL) in
/// types of their own: their interleaved rows load as f32 (which holds
/// both exactly), the down projection stays in its own type (Q8_0), and
/// the weights' byte count before loading counts the pair as f32. (The
/// conformance test checks the logits.)
#[test]
fn gate_and_up_of_different_types_load_as_f32() {
    use wgspark::WeightFormat;
    use wgspark::model::layers::FfnWeights;
    let gpu = common::gpu(common::backends()[0]);
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gguf_llama_gate_up_apart/model.gguf");
    let model = wgspark::Model::load(std::path::Path::new(path), &gpu).unwrap();
    for (i, layer) in model.weights().layers.iter().enumerate() {
        let FfnWeights::Dense { gate_up, down } = &layer.ffn else { panic!("layer {i} is dense") };
        let formats = |t: &wgspark::gpu::GpuTensor| t.parts.iter().map(|p| p.format).collect::<Vec<_>>();
        assert!(
            formats(gate_up).iter().all(|&f| f == WeightFormat::F32),
            "layer {i}: {:?}",
            formats(gate_up)
        );
        assert!(formats(down).iter().all(|&f| f == WeightFormat::Q8_0), "layer {i}: {:?}", formats(down));
    }
    let checkpoint =
        wgspark::model::gguf_checkpoint::GgufCheckpoint::open(std::path::Path::new(path)).unwrap();
    assert_eq!(checkpoint.gpu_bytes(), model.weights().bytes(), "bytes counted before loading");
}
