//! Bicubic resampling of 8-bit images, computed as Pillow computes it
//! (`Image.resize(..., BICUBIC)`, what transformers' image processors call):
//! a separable convolution, horizontal pass then vertical, whose kernel
//! (Keys' cubic, a = -0.5) widens with the downscaling factor, weights
//! normalised per output pixel in f64 and then rounded to 22-bit fixed
//! point, every pass rounded and clipped back to 8 bits. Same arithmetic,
//! same bytes.

use std::borrow::Cow;

use rayon::prelude::*;

/// Fixed-point fraction bits of the weights: 32 bits less 8 of value and 2
/// of headroom for kernels whose partial sums leave 0..1.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// Keys' cubic convolution kernel with a = -0.5, support 2.
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// For each output position along an axis of `in_size` resampled to
/// `out_size`: the first input position it reads and its fixed-point
/// weights.
struct Taps {
    first: Vec<usize>,
    weights: Vec<Vec<i32>>,
}

impl Taps {
    fn new(in_size: usize, out_size: usize) -> Taps {
        let scale = in_size as f64 / out_size as f64;
        let filter_scale = scale.max(1.0);
        let support = 2.0 * filter_scale;
        let mut first = Vec::with_capacity(out_size);
        let mut weights = Vec::with_capacity(out_size);
        for xx in 0..out_size {
            let center = (xx as f64 + 0.5) * scale;
            // Truncations toward zero of values at least -0.5 + 0.5, as C's casts.
            let lo = ((center - support + 0.5) as i64).max(0) as usize;
            let hi = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            // Pillow multiplies by the reciprocal, which rounds differently
            // from a division.
            let inverse = 1.0 / filter_scale;
            let raw: Vec<f64> = (lo..hi).map(|x| bicubic((x as f64 - center + 0.5) * inverse)).collect();
            let total: f64 = raw.iter().sum();
            let fixed = raw
                .iter()
                .map(|&w| {
                    let w = if total != 0.0 { w / total } else { w };
                    let scaled = w * (1u32 << PRECISION_BITS) as f64;
                    (if w < 0.0 { scaled - 0.5 } else { scaled + 0.5 }) as i32
                })
                .collect();
            first.push(lo);
            weights.push(fixed);
        }
        Taps { first, weights }
    }

    /// Output `i`'s taps: the input positions it reads and their weights.
    fn of(&self, i: usize) -> impl Iterator<Item = (usize, i32)> + '_ {
        self.weights[i].iter().enumerate().map(move |(j, &w)| (self.first[i] + j, w))
    }

    /// A row of RGB pixels resampled into `out`, the three channels of an
    /// output pixel summed side by side.
    fn resample_row(&self, row: &[u8], out: &mut [u8]) {
        for (x, pixel) in out.chunks_exact_mut(3).enumerate() {
            let mut sums = [ROUNDING; 3];
            for (i, w) in self.of(x) {
                for (sum, &v) in sums.iter_mut().zip(&row[i * 3..i * 3 + 3]) {
                    *sum += i32::from(v) * w;
                }
            }
            for (p, sum) in pixel.iter_mut().zip(sums) {
                *p = to_byte(sum);
            }
        }
    }
}

/// Where a weighted sum starts: a half in fixed point, so that the shift
/// in [`to_byte`] rounds.
const ROUNDING: i32 = 1 << (PRECISION_BITS - 1);

/// A weighted sum of 8-bit values, rounded and clipped back to 8 bits.
/// The weights' magnitudes add up to less than 1.3 (2^22 in fixed point),
/// so that no partial sum of 255 times them overflows, in any order.
fn to_byte(sum: i32) -> u8 {
    (sum >> PRECISION_BITS).clamp(0, 255) as u8
}

/// `rgb` (`width * height` pixels of 3 bytes, rows top to bottom) resized
/// to `out_width x out_height`. An axis whose size does not change is not
/// resampled; the vertical pass comes first when the height shrinks by
/// more than twice what the width does, as in Pillow 13 (which order runs
/// first changes the 8-bit rounding between the passes).
pub fn resize_rgb(rgb: &[u8], width: usize, height: usize, out_width: usize, out_height: usize) -> Vec<u8> {
    let shrink = |from: usize, to: usize| from as i64 - to as i64;
    let vertical_first =
        shrink(height, out_height) > 0 && shrink(height, out_height) > 2 * shrink(width, out_width);
    let image = Plane { pixels: Cow::Borrowed(rgb), width, height };
    let image = if vertical_first {
        image.vertical(out_height).horizontal(out_width)
    } else {
        image.horizontal(out_width).vertical(out_height)
    };
    image.pixels.into_owned()
}

/// An RGB image in one of the passes (the first reads the caller's).
struct Plane<'a> {
    pixels: Cow<'a, [u8]>,
    width: usize,
    height: usize,
}

impl<'a> Plane<'a> {
    /// Rows are resampled in parallel.
    fn horizontal(self, out_width: usize) -> Plane<'a> {
        if out_width == self.width {
            return self;
        }
        let taps = Taps::new(self.width, out_width);
        let mut out = vec![0u8; out_width * self.height * 3];
        let rows = self.pixels.par_chunks(self.width * 3);
        out.par_chunks_mut(out_width * 3).zip(rows).for_each(|(out, row)| taps.resample_row(row, out));
        Plane { pixels: Cow::Owned(out), width: out_width, height: self.height }
    }

    /// Output rows are resampled in parallel, each as whole input rows
    /// times their weights added up (rows read in order, not a column at
    /// a time).
    fn vertical(self, out_height: usize) -> Plane<'a> {
        if out_height == self.height {
            return self;
        }
        let (row_len, taps) = (self.width * 3, Taps::new(self.height, out_height));
        let mut out = vec![0u8; row_len * out_height];
        out.par_chunks_mut(row_len).enumerate().for_each_init(Vec::new, |sums, (y, out)| {
            sums.clear();
            sums.resize(row_len, ROUNDING);
            for (i, w) in taps.of(y) {
                for (sum, &v) in sums.iter_mut().zip(&self.pixels[i * row_len..(i + 1) * row_len]) {
                    *sum += i32::from(v) * w;
                }
            }
            for (p, &sum) in out.iter_mut().zip(sums.iter()) {
                *p = to_byte(sum);
            }
        });
        Plane { pixels: Cow::Owned(out), width: self.width, height: out_height }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_in_fixed_point_and_flat_images_stay_flat() {
        for (n, m) in [(7, 3), (3, 7), (100, 37), (37, 100), (5, 5)] {
            let taps = Taps::new(n, m);
            for w in &taps.weights {
                let total: i64 = w.iter().map(|&v| v as i64).sum();
                assert!((total - (1 << PRECISION_BITS)).abs() <= w.len() as i64, "{n} -> {m}: {total}");
            }
        }
        let flat = vec![200u8; 13 * 9 * 3];
        assert!(resize_rgb(&flat, 13, 9, 31, 4).iter().all(|&v| v == 200));
        // An unchanged size is a copy.
        let noise: Vec<u8> = (0..6 * 5 * 3).map(|i| (i * 37 % 251) as u8).collect();
        assert_eq!(resize_rgb(&noise, 6, 5, 6, 5), noise);
    }
}
