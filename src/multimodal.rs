//! Prompts of text and images (Qwen3-VL). Each image goes through the
//! vision tower; in the prompt it stands as one `image_token_id` token per
//! merged row, whose embedding the row replaces and to which, after the
//! language model's first layers, the deepstack rows are added. Positions
//! are what the language model rotates by, as transformers'
//! `get_rope_index` gives them: `(p, p, p)` for text, `(s, s + row, s +
//! column)` over an image's merged grid starting at `s`, and
//! text after an image continuing from the largest position + 1. The
//! session keeps each cache slot's rotary row in its table, so decoding
//! after an image rotates by `slot + offset` with no flag on the GPU.

use crate::error::{Error, Result};
use crate::flow::vision::{ImageRows, encode_image};
use crate::flow::{Activations, ChunkMedia, RowCopy};
use crate::gpu::Gpu;
use crate::kernels::gemm::Gemm;
use crate::model::{Model, ModelConfig};
use crate::vision::RgbImage;

/// A part of a prompt: token ids, or an image.
///
/// ```no_run
/// use std::path::Path;
/// use wgspark::{GenerateOptions, Gpu, Message, Model, PromptPart, RgbImage, SessionOptions, TextStream};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let gpu = Gpu::from_env()?;
/// let model = Model::load("path/to/Qwen3-VL-2B-Instruct", &gpu)?;
/// let tokenizer = model.tokenizer()?.ok_or("the model has no tokenizer")?;
/// let template = model.chat_template()?.ok_or("the model has no chat template")?;
/// let images = [RgbImage::open(Path::new("photo.jpg"))?];
/// let message = Message::with_images("user", images.len(), "What is in this picture?");
/// let ids = tokenizer.encode(&template.render(&[message], true)?)?;
/// // Qwen3-VL's template writes <|vision_start|><|image_pad|><|vision_end|>
/// // for an image: the placeholder is where the image's rows go.
/// let placeholder = tokenizer.token_id("<|image_pad|>").ok_or("no image placeholder")?;
/// let parts = PromptPart::split(&ids, placeholder, &images)?;
/// let mut session = model.session(&SessionOptions::default())?;
/// let stop_tokens = model.config.eos_token_ids.clone();
/// let options = GenerateOptions { stop_tokens, ..GenerateOptions::default() };
/// let mut text = TextStream::new(&tokenizer, true);
/// for id in session.generate_multimodal(&parts, &options)? {
///     print!("{}", text.push(id?)?);
/// }
/// println!("{}", text.finish()?);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy)]
pub enum PromptPart<'a> {
    /// Token ids, as the tokenizer gives them.
    Text(&'a [u32]),
    /// An image, which becomes as many tokens as it has merged rows (the
    /// caller's text holds what the model's chat template puts around it,
    /// such as Qwen3-VL's `<|vision_start|>` and `<|vision_end|>`).
    Image(&'a RgbImage),
}

impl<'a> PromptPart<'a> {
    /// The parts of a prompt of ids in which `image_token` stands once for
    /// each of `images`, in order (as a chat template renders an image).
    pub fn split(ids: &'a [u32], image_token: u32, images: &'a [RgbImage]) -> Result<Vec<PromptPart<'a>>> {
        let placeholders = ids.iter().filter(|&&t| t == image_token).count();
        if placeholders != images.len() {
            return Err(Error::ImageCount { token: image_token, placeholders, images: images.len() });
        }
        let mut parts = Vec::new();
        let mut images = images.iter();
        for (i, text) in ids.split(|&t| t == image_token).enumerate() {
            if i > 0 {
                parts.push(PromptPart::Image(images.next().expect("counted above")));
            }
            if !text.is_empty() {
                parts.push(PromptPart::Text(text));
            }
        }
        Ok(parts)
    }
}

/// The ids `parts` run as: each image's placeholder repeated once per
/// merged row of it (what transformers' processor makes of the prompt).
pub fn expanded_ids(model: &Model, parts: &[PromptPart<'_>]) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for part in parts {
        match part {
            PromptPart::Text(text) => ids.extend_from_slice(text),
            PromptPart::Image(image) => {
                let (processor, v) = match (&model.image_processor, &model.config.vision) {
                    (Some(p), Some(v)) => (p, v),
                    _ => return Err(no_images(model)),
                };
                let token = v.tokens.image.ok_or_else(|| no_images(model))?;
                let (h, w) = processor
                    .resized_size(image.height, image.width)
                    .map_err(|message| Error::Image { origin: "image".into(), message })?;
                let side = processor.patch_size * processor.merge_size;
                ids.extend(std::iter::repeat_n(token, (h / side) * (w / side)));
            }
        }
    }
    Ok(ids)
}

fn no_images(model: &Model) -> Error {
    Error::Unsupported {
        what: "images for a model without a vision tower, its image processor (preprocessor_config.json) or an image_token_id",
        value: model.config.model_type.clone(),
    }
}

/// A prompt ready to run: its ids (images expanded), each token's position
/// triple, and the images' rows.
pub(crate) struct PreparedPrompt {
    pub ids: Vec<u32>,
    pub positions: Vec<[u32; 3]>,
    /// Each image's first token (an index into `ids`) and its rows.
    pub images: Vec<(usize, ImageRows)>,
}

impl PreparedPrompt {
    /// `parts` from position `first`: images through the tower, text as it
    /// is.
    pub fn new(model: &Model, parts: &[PromptPart<'_>], first: u32, gemm: Option<&Gemm>) -> Result<Self> {
        let mut prompt = PreparedPrompt { ids: Vec::new(), positions: Vec::new(), images: Vec::new() };
        let mut next = first;
        for part in parts {
            match part {
                PromptPart::Text(ids) => {
                    prompt.ids.extend_from_slice(ids);
                    prompt.positions.extend((0..ids.len() as u32).map(|i| [next + i; 3]));
                    next += ids.len() as u32;
                }
                PromptPart::Image(image) => {
                    let rows = image_rows(model, image, gemm)?;
                    let token =
                        model.config.vision.as_ref().and_then(|v| v.tokens.image).ok_or_else(|| {
                            Error::Unsupported {
                                what: "images for a model whose config has no image_token_id",
                                value: model.config.model_type.clone(),
                            }
                        })?;
                    let [_, gh, gw] = rows.grid;
                    prompt.images.push((prompt.ids.len(), rows));
                    prompt.ids.extend(std::iter::repeat_n(token, gh * gw));
                    for row in 0..gh as u32 {
                        prompt.positions.extend((0..gw as u32).map(|col| [next, next + row, next + col]));
                    }
                    next += gh.max(gw) as u32;
                }
            }
        }
        Ok(prompt)
    }

    /// A prompt of text alone (its positions are the slots' own: not
    /// needed).
    pub fn text(parts: &[PromptPart<'_>]) -> Self {
        let ids = parts
            .iter()
            .flat_map(|p| match p {
                PromptPart::Text(ids) => *ids,
                PromptPart::Image(_) => &[],
            })
            .copied()
            .collect();
        PreparedPrompt { ids, positions: Vec::new(), images: Vec::new() }
    }

    /// The media of the chunk holding tokens `chunk` of the prompt: the
    /// images' rows for the tokens that are theirs.
    pub fn chunk_media(
        &self,
        model: &Model,
        act: &Activations,
        chunk: std::ops::Range<usize>,
    ) -> Result<ChunkMedia<'_>> {
        let mut media = ChunkMedia::default();
        add_image_rows(model, act, &self.images, chunk, 0, &mut media)?;
        Ok(media)
    }
}

/// Adds to `media` what `images` (each image's first token and its rows)
/// put in a pass that runs tokens `tokens` of their prompt from its row
/// `first_row` on: each image's rows copied over its tokens' embeddings,
/// and its deepstack rows added after the first layers.
pub(crate) fn add_image_rows<'a>(
    model: &Model,
    act: &Activations,
    images: &'a [(usize, ImageRows)],
    tokens: std::ops::Range<usize>,
    first_row: usize,
    media: &mut ChunkMedia<'a>,
) -> Result<()> {
    for (start, rows) in images {
        let (lo, hi) = (tokens.start.max(*start), tokens.end.min(start + rows.tokens));
        if lo >= hi {
            continue;
        }
        let (src_row, dst_row, count) = (lo - start, first_row + lo - tokens.start, hi - lo);
        media.copies.push(RowCopy { src: &rows.merged, src_row, dst_row, rows: count });
        for (layer, deep) in rows.deepstack.iter().enumerate() {
            let add = model.kernels.residual.plan_rows(
                &model.gpu,
                act.hidden,
                (deep, src_row),
                (&act.x, dst_row),
            )?;
            media.after_layer.resize_with(media.after_layer.len().max(layer + 1), Vec::new);
            media.after_layer[layer].push((add, count as u32));
        }
    }
    Ok(())
}

/// An image's rows from the tower, patched by the model's processor.
fn image_rows(model: &Model, image: &RgbImage, gemm: Option<&Gemm>) -> Result<ImageRows> {
    let processor = model.image_processor.as_ref().ok_or_else(|| no_images(model))?;
    let patches = processor.patches(image, "image")?;
    encode_image(model, &patches, gemm)
}

/// The rotary rows of a session's cache slots: every slot's row is the
/// rotation of its token's position, and from `plain_from` on, of `slot +
/// offset` (the positions text takes there).
#[derive(Debug)]
pub(crate) struct SlotPositions {
    plain_from: usize,
    offset: i64,
    /// The largest position component of the tokens up to each slot.
    largest: Vec<u32>,
}

impl SlotPositions {
    pub fn new(context_len: usize) -> Self {
        SlotPositions { plain_from: 0, offset: 0, largest: vec![0; context_len] }
    }

    /// The position the token at `slot` (the session's length) takes as
    /// text.
    pub fn next(&self, slot: usize) -> u32 {
        if slot == 0 { 0 } else { self.largest[slot - 1] + 1 }
    }

    /// Records tokens at `slot..` of the given positions (text after the
    /// slots the table already rotates as text: `None`).
    pub fn record(&mut self, slot: usize, count: usize, positions: Option<&[[u32; 3]]>) {
        let mut largest = if slot == 0 { 0 } else { self.largest[slot - 1] };
        for i in 0..count {
            let p = match positions {
                Some(p) => *p[i].iter().max().expect("three components"),
                None => (slot as i64 + i as i64 + self.offset) as u32,
            };
            largest = if slot + i == 0 { p } else { largest.max(p) };
            self.largest[slot + i] = largest;
        }
    }

    /// Writes the rows of a prompt's `positions` from `slot` and, after
    /// them, text rows continuing from their largest position + 1.
    pub fn place_prompt(
        &mut self,
        gpu: &Gpu,
        act: &Activations,
        c: &ModelConfig,
        slot: usize,
        positions: &[[u32; 3]],
    ) {
        let end = slot + positions.len();
        let next = positions.iter().flat_map(|p| p.iter()).max().map_or(self.next(slot), |&m| m + 1);
        let offset = next as i64 - end as i64;
        let mut rows: Vec<f32> = positions.iter().flat_map(|&p| c.rotary_row(p)).collect();
        rows.extend(self.text_rows(c, end, offset));
        act.write_rotary_rows(gpu, slot, &rows);
        self.plain_from = end;
        self.offset = offset;
    }

    /// After the session is cut back to `len`: the slots from `len` on
    /// rotate as text continuing from the kept tokens.
    pub fn truncate(&mut self, gpu: &Gpu, act: &Activations, c: &ModelConfig, len: usize) {
        let offset = self.next(len) as i64 - len as i64;
        if len < self.plain_from || offset != self.offset {
            act.write_rotary_rows(gpu, len, &self.text_rows(c, len, offset));
            self.plain_from = len;
            self.offset = offset;
        }
    }

    /// Text rows from `slot` to the end of the context at `slot + offset`.
    fn text_rows(&self, c: &ModelConfig, slot: usize, offset: i64) -> Vec<f32> {
        (slot..self.largest.len())
            .flat_map(|s| {
                let p = (s as i64 + offset).max(0) as u32;
                c.rotary_row([p; 3])
            })
            .collect()
    }
}
