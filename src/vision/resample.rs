//! Bicubic resampling of 8-bit images, computed as Pillow computes it
//! (`Image.resize(..., BICUBIC)`, what transformers' image processors call):
//! a separable convolution, horizontal pass then vertical, whose kernel
//! (Keys' cubic, a = -0.5) widens with the downscaling factor, weights
//! normalised per output pixel in f64 and then rounded to 22-bit fixed
//! point, every pass rounded and clipped back to 8 bits. Same arithmetic,
//! same bytes.

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

    /// Output `i`'s weighted sum of `value(first + j)`, rounded and clipped
    /// to 8 bits.
    fn apply(&self, i: usize, value: impl Fn(usize) -> u8) -> u8 {
        let mut sum: i32 = 1 << (PRECISION_BITS - 1);
        for (j, &w) in self.weights[i].iter().enumerate() {
            // At most 255 x 1.25 x 2^22 in magnitude: no overflow.
            sum += i32::from(value(self.first[i] + j)) * w;
        }
        (sum >> PRECISION_BITS).clamp(0, 255) as u8
    }
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
    let image = Plane { pixels: rgb.to_vec(), width, height };
    let image = if vertical_first {
        image.vertical(out_height).horizontal(out_width)
    } else {
        image.horizontal(out_width).vertical(out_height)
    };
    image.pixels
}

/// An RGB image in one of the passes.
struct Plane {
    pixels: Vec<u8>,
    width: usize,
    height: usize,
}

impl Plane {
    fn horizontal(self, out_width: usize) -> Plane {
        if out_width == self.width {
            return self;
        }
        let taps = Taps::new(self.width, out_width);
        let mut out = vec![0u8; out_width * self.height * 3];
        for y in 0..self.height {
            let row = &self.pixels[y * self.width * 3..(y + 1) * self.width * 3];
            for x in 0..out_width {
                for c in 0..3 {
                    out[(y * out_width + x) * 3 + c] = taps.apply(x, |i| row[i * 3 + c]);
                }
            }
        }
        Plane { pixels: out, width: out_width, height: self.height }
    }

    fn vertical(self, out_height: usize) -> Plane {
        if out_height == self.height {
            return self;
        }
        let (w, taps) = (self.width, Taps::new(self.height, out_height));
        let mut out = vec![0u8; w * out_height * 3];
        for y in 0..out_height {
            for x in 0..w {
                for c in 0..3 {
                    out[(y * w + x) * 3 + c] = taps.apply(y, |i| self.pixels[(i * w + x) * 3 + c]);
                }
            }
        }
        Plane { pixels: out, width: w, height: out_height }
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
