//! Sampling: greedy is argmax, seeded sampling is reproducible, and top-k /
//! top-p cut the candidates as specified.

use wgspark::{Sampler, Sampling};

fn random(temperature: f32, top_k: Option<usize>, top_p: Option<f32>, seed: u64) -> Sampler {
    Sampler::new(Sampling::Random { temperature, top_k, top_p }, seed).unwrap()
}

#[test]
fn greedy_takes_the_highest_logit_and_the_lowest_id_on_ties() {
    let mut s = Sampler::greedy();
    assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]), 1);
    assert_eq!(s.sample(&[1.0, 5.0, 5.0]), 1);
    assert_eq!(s.sample(&[f32::NAN, 0.5, 0.2]), 1, "NaN never wins");
}

#[test]
fn the_same_seed_gives_the_same_tokens() {
    let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 17) as f32 * 0.3).collect();
    let draw = |seed| {
        let mut s = random(1.0, None, None, seed);
        (0..50).map(|_| s.sample(&logits)).collect::<Vec<_>>()
    };
    assert_eq!(draw(7), draw(7));
    assert_ne!(draw(7), draw(8));
}

#[test]
fn top_k_and_top_p_restrict_the_candidates() {
    let logits = [4.0, 3.9, 3.8, 0.0, -1.0, 3.7];
    let mut s = random(1.0, Some(2), None, 1);
    for _ in 0..200 {
        assert!(matches!(s.sample(&logits), 0 | 1), "only the two best survive top_k = 2");
    }
    // p(0) is about 0.29: top_p = 0.1 keeps only the best token.
    let mut s = random(1.0, None, Some(0.1), 1);
    assert!((0..100).all(|_| s.sample(&logits) == 0));
    let mut s = random(1.0, Some(1), None, 3);
    assert!((0..100).all(|_| s.sample(&logits) == 0), "top_k = 1 is greedy");
}

#[test]
fn frequencies_follow_the_tempered_softmax() {
    let logits = [1.0f32, 0.0, -1.0];
    for temperature in [0.5f32, 1.0, 2.0] {
        let mut s = random(temperature, None, None, 42);
        let mut counts = [0usize; 3];
        let n = 20_000;
        for _ in 0..n {
            counts[s.sample(&logits) as usize] += 1;
        }
        let z: f32 = logits.iter().map(|l| (l / temperature).exp()).sum();
        for i in 0..3 {
            let want = (logits[i] / temperature).exp() / z;
            let got = counts[i] as f32 / n as f32;
            assert!((got - want).abs() < 0.015, "T {temperature}, token {i}: {got} vs {want}");
        }
    }
}
