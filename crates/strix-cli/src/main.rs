//! The `strix` command: argument parsing and dispatch to the subcommands, and the one place
//! where an error becomes a message on stderr and a non-zero exit status.

mod bench;
mod bench_serve;
mod chat;
mod common;
mod device;
mod logits;
mod perplexity;
mod quant_flag;
mod quantize;
mod run;
mod serve;

use clap::{Parser, Subcommand};

const ABOUT: &str =
    "Run Qwen3.5 hybrid (Gated DeltaNet + attention) language models on the CPU or an NVIDIA GPU";

const LONG_ABOUT: &str = "Run Qwen3.5 hybrid (Gated DeltaNet + attention) language models on the CPU or an
NVIDIA GPU (--device auto|cpu|cuda|cuda:N; auto, the default, takes the first CUDA GPU when one
is usable).

A model is a Hugging Face model directory (config.json, *.safetensors, tokenizer.json,
chat_template.jinja), a llama.cpp `qwen35` GGUF file (tokenizer and chat template from its
metadata unless a tokenizer.json is beside it), or a Hugging Face repo id such as
Qwen/Qwen3.5-2B, downloaded to the Hugging Face cache on first use. With no --model, run and chat use Qwen/Qwen3.5-0.8B.";

const EXAMPLES: &str = "Examples:
  strix run \"The capital of France is\"
  strix run --model ./Qwen3.5-2B --chat --no-think \"Write a haiku about rust\"
  strix run --model ./Qwen3.5-2B --temperature 0 --max-tokens 32 --json \"1, 2, 3,\"
  strix chat --model ./Qwen3.5-2B --system \"You are terse.\"
  strix logits --model ./Qwen3.5-2B --prompt-ids 1,2,3 --out logits.safetensors
  strix quantize --model ./Qwen3.5-2B --quant q8_0 --out Qwen3.5-2B-Q8_0.gguf
  strix run --model Qwen3.5-2B-Q8_0.gguf --temperature 0 \"Hello\"
  strix bench --preset qwen3.5-0.8b --prompt-len 512 --gen 32
  strix bench --device cuda --preset qwen3.5-9b
  strix perplexity --model ./Qwen3.5-2B --file wiki.test.raw --ctx 512 --quant q4_k";

#[derive(Parser)]
#[command(name = "strix", version, about = ABOUT, long_about = LONG_ABOUT, after_help = EXAMPLES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a completion of one prompt, streamed to stdout
    Run(run::RunArgs),
    /// Chat turn by turn: one user message per line of stdin, answers streamed to stdout
    Chat(chat::ChatArgs),
    /// Write the logits of every prompt position to a safetensors file
    Logits(logits::LogitsArgs),
    /// Measure prefill and decode speed, and decode speed against memory bandwidth
    Bench(bench::BenchArgs),
    /// Measure a running OpenAI-compatible server: N streaming clients, throughput, ttft, itl
    BenchServe(bench_serve::BenchServeArgs),
    /// Serve the OpenAI API over HTTP, with continuous batching
    Serve(serve::ServeArgs),
    /// Perplexity of a text file (llama.cpp's definition), or KL divergence against a base run
    Perplexity(perplexity::PerplexityArgs),
    /// Write a model directory as a llama.cpp GGUF file with quantized matrices
    Quantize(quantize::QuantizeArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run::run(args),
        Command::Chat(args) => chat::chat(args),
        Command::Logits(args) => logits::logits(args),
        Command::Bench(args) => bench::bench(args),
        Command::BenchServe(args) => bench_serve::bench_serve(args),
        Command::Serve(args) => serve::serve(args),
        Command::Perplexity(args) => perplexity::perplexity(args),
        Command::Quantize(args) => quantize::quantize(args),
    };
    if let Err(e) = result {
        // One line, so scripts and logs keep the whole message together.
        let message = format!("{e:#}").replace('\n', " ");
        eprintln!("error: {message}");
        std::process::exit(1);
    }
}
