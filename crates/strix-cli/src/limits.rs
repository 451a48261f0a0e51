//! What the command line accepts for its numbers: a parser per kind of count with its bounds,
//! so a negative, absurd or mistyped value fails while the arguments are read, with clap's
//! message naming the flag (`invalid value '-1' for '--max-tokens <N>': must be at least 1`),
//! before any model is loaded, thread spawned or buffer allocated. The bounds are far above
//! any real use; what they stop is arithmetic overflow and allocations sized by a typo.

/// Most tokens any token-count flag takes (contexts, prompt and generation lengths, passes):
/// 64 times Qwen3.5's 262,144 positions.
pub const MAX_TOKENS: usize = 1 << 24;

/// Worker threads per logical CPU at most: the model's threads compute all the time, so more
/// than one per CPU only slows it; a few times that is left for experiments.
pub const THREADS_PER_CPU: usize = 4;

/// Most sequences a `bench --batches` measurement decodes together.
pub const MAX_BATCH: usize = 1024;

/// Most timed repetitions of a `bench` measurement.
pub const MAX_REPEATS: usize = 1000;

/// Largest bandwidth probe `bench --bandwidth-mib` allocates (1 TiB); the memory actually
/// available is checked once the device is open.
pub const MAX_BANDWIDTH_MIB: usize = 1 << 20;

/// Most bytes of a prompt read from stdin, and of one `chat` message: far more text than any
/// context holds (a token covers at least one byte), and a bound on what `/dev/zero` or a
/// runaway pipe can make the command hold.
pub const MAX_PROMPT_BYTES: u64 = 16 << 20;

/// Most bytes of a `perplexity --file` text (wiki.test.raw is 1.3 MB).
pub const MAX_TEXT_FILE_BYTES: u64 = 256 << 20;

/// A `--stop` string: an empty one would match before any text.
pub fn stop_text(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err("must not be empty (it would match before any text)".to_string());
    }
    Ok(text.to_string())
}

/// `text` as a whole number within `min..=max`, or a message saying what is wrong with it.
/// `what` explains the upper bound.
fn whole(text: &str, min: usize, max: usize, what: &str) -> Result<usize, String> {
    let trimmed = text.trim();
    let n: i128 = trimmed.parse().map_err(|_| {
        if trimmed.parse::<f64>().is_ok() {
            format!("`{trimmed}` is not a whole number")
        } else {
            format!("`{trimmed}` is not a number")
        }
    })?;
    if n < min as i128 {
        return Err(match min {
            0 => "must be 0 or more".to_string(),
            _ => format!("must be at least {min}"),
        });
    }
    if n > max as i128 {
        return Err(match what {
            "" => format!("must be at most {max}"),
            _ => format!("must be at most {max} ({what})"),
        });
    }
    Ok(n as usize)
}

/// A token count: a context, a prompt or generation length, a pass.
pub fn tokens(text: &str) -> Result<usize, String> {
    whole(text, 1, MAX_TOKENS, "tokens; more than any model's context")
}

/// Most worker threads: [`THREADS_PER_CPU`] per logical CPU of this machine.
pub fn max_threads() -> usize {
    THREADS_PER_CPU * std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `--threads`.
pub fn threads(text: &str) -> Result<usize, String> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let why = format!(
        "{THREADS_PER_CPU} per logical CPU, and this machine has {cpus}; more only slow the model down"
    );
    whole(text, 1, max_threads(), &why)
}

/// `bench --repeats`.
pub fn repeats(text: &str) -> Result<usize, String> {
    whole(text, 1, MAX_REPEATS, "repetitions")
}

/// A `bench --batches` entry.
pub fn batch(text: &str) -> Result<usize, String> {
    whole(text, 1, MAX_BATCH, "sequences decoded together")
}

/// `bench --bandwidth-mib` (0 skips the measurement).
pub fn bandwidth_mib(text: &str) -> Result<usize, String> {
    whole(text, 0, MAX_BANDWIDTH_MIB, "MiB")
}

/// `--top-k` (0: all tokens). Any size is meaningful: it is capped by the vocabulary.
pub fn top_k(text: &str) -> Result<usize, String> {
    whole(text, 0, usize::MAX, "")
}

/// Most sequences `serve --max-seqs` decodes together, and most requests `--max-queue` holds.
pub const MAX_SERVE_SEQS: usize = 4096;
pub const MAX_SERVE_QUEUE: usize = 1 << 20;

/// `serve --max-seqs`.
pub fn serve_seqs(text: &str) -> Result<usize, String> {
    whole(text, 1, MAX_SERVE_SEQS, "sequences decoded together")
}

/// `serve --max-queue` (0: no waiting beyond a full batch).
pub fn serve_queue(text: &str) -> Result<usize, String> {
    whole(text, 0, MAX_SERVE_QUEUE, "waiting requests")
}

/// `serve --max-body`: 1 byte to 1 GiB.
pub fn body_bytes(text: &str) -> Result<usize, String> {
    whole(text, 1, 1 << 30, "bytes; 1 GiB")
}

/// A `serve` timeout: 1 second to a day.
pub fn seconds(text: &str) -> Result<u64, String> {
    whole(text, 1, 86_400, "seconds; a day").map(|n| n as u64)
}

/// `serve --max-connections` (the open-file limit lowers it further at start).
pub fn connections(text: &str) -> Result<usize, String> {
    whole(text, 1, 1 << 20, "connections")
}

/// `serve --state-budget-mib`: at most 1 TiB.
pub fn budget_mib(text: &str) -> Result<u64, String> {
    whole(text, 1, 1 << 20, "MiB; 1 TiB").map(|n| n as u64)
}

/// A memory budget in MiB that may be 0 (`serve --prefix-cache-mib`: 0 turns the cache off).
pub fn budget_mib_or_off(text: &str) -> Result<u64, String> {
    whole(text, 0, 1 << 20, "MiB; 1 TiB").map(|n| n as u64)
}

/// A count of at least 1 with no bound of its own (`perplexity --chunks`).
pub fn positive(text: &str) -> Result<usize, String> {
    whole(text, 1, usize::MAX, "")
}

/// A `--logit-bias` entry, `ID=BIAS`: a token id and the bias added to its logit, in [-100, 100]
/// (OpenAI's range); the vocabulary is checked once the model is loaded.
pub fn logit_bias(text: &str) -> Result<(u32, f32), String> {
    let shape = || format!("`{text}` is not ID=BIAS (a token id, a bias in [-100, 100]), e.g. 1234=-100");
    let (id, bias) = text.split_once('=').ok_or_else(shape)?;
    let id = id.trim().parse::<u32>().map_err(|_| shape())?;
    let bias = bias.trim().parse::<f32>().map_err(|_| shape())?;
    let max = strix::sampling::LOGIT_BIAS_MAX;
    if !(-max..=max).contains(&bias) {
        return Err(format!("the bias of token {id} must be in [-100, 100], not {bias}"));
    }
    Ok((id, bias))
}

/// A `--seed` value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seed {
    /// `-1`, llama.cpp's spelling of "draw a random seed".
    Random,
    Fixed(u64),
}

/// `--seed`: a seed, or -1 for a random one as in llama.cpp.
pub fn seed(text: &str) -> Result<Seed, String> {
    match text.trim() {
        "-1" => Ok(Seed::Random),
        t => t.parse::<u64>().map(Seed::Fixed).map_err(|_| {
            if t.parse::<i128>().is_ok() {
                format!("must be 0 to {} or -1 (a random seed)", u64::MAX)
            } else {
                format!("`{t}` is not a whole number (give 0 to {}, or -1 for a random seed)", u64::MAX)
            }
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logit_bias_entries_are_an_id_and_a_bounded_bias() {
        assert_eq!(logit_bias("1234=-100"), Ok((1234, -100.0)));
        assert_eq!(logit_bias(" 7 = 2.5 "), Ok((7, 2.5)));
        for bad in ["1234", "=5", "x=1", "-1=1", "1=x", "1=", "4294967296=1"] {
            assert!(logit_bias(bad).unwrap_err().contains("is not ID=BIAS"), "{bad}");
        }
        for bad in ["1=100.5", "1=-101", "1=NaN", "1=inf"] {
            assert!(logit_bias(bad).unwrap_err().contains("must be in [-100, 100]"), "{bad}");
        }
    }

    #[test]
    fn counts_are_bounded_with_messages_that_say_why() {
        assert_eq!(tokens(" 512 "), Ok(512));
        assert_eq!(tokens("-1").unwrap_err(), "must be at least 1");
        assert_eq!(tokens("0").unwrap_err(), "must be at least 1");
        assert!(tokens(&(MAX_TOKENS + 1).to_string()).unwrap_err().contains("at most 16777216"));
        assert!(tokens("99999999999999999999999999").unwrap_err().contains("at most"));
        assert!(tokens("1e3").unwrap_err().contains("not a whole number"));
        assert!(tokens("x").unwrap_err().contains("not a number"));
        assert_eq!(top_k("0"), Ok(0));
        assert_eq!(top_k("-1").unwrap_err(), "must be 0 or more");
        assert_eq!(positive("0").unwrap_err(), "must be at least 1");
        assert_eq!(bandwidth_mib("0"), Ok(0));
        assert!(batch("100000").unwrap_err().contains("at most 1024"));
        assert_eq!(threads("1"), Ok(1));
        assert!(threads("10000").unwrap_err().contains("per logical CPU"));
        assert!(threads(&max_threads().to_string()).is_ok());
    }

    #[test]
    fn seeds_take_minus_one_as_random() {
        assert_eq!(seed("-1"), Ok(Seed::Random));
        assert_eq!(seed("42"), Ok(Seed::Fixed(42)));
        assert_eq!(seed(&u64::MAX.to_string()), Ok(Seed::Fixed(u64::MAX)));
        assert!(seed("-2").unwrap_err().contains("-1 (a random seed)"));
        assert!(seed("abc").unwrap_err().contains("not a whole number"));
    }
}
