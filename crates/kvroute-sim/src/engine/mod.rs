//! The realistic simulated engine (`kvroute-sim --mode engine`).
//!
//! One process serves N engines on consecutive ports. Each engine behaves,
//! from outside, like one vLLM (V1) server: OpenAI-style completions with
//! streaming, vLLM's metric names, and the polling endpoints of peer
//! routers. Inside, it runs a model of what makes LLM serving uneven: a
//! paged KV cache with prefix caching, continuous batching with chunked
//! prefill, preemption when the cache runs out, and a step time that grows
//! with prefill tokens and decode context.
//!
//! # Model
//!
//! * Tokens: prompt bytes / 4, rounded up ([`tokens_of`]). Chat prompts
//!   come from a fixed template ([`chat_prompt`]) built so that a next
//!   turn's prompt extends the previous prompt plus its answer (see
//!   [`prompt`]); completions take the prompt string (or the concatenated
//!   array) as is.
//! * KV cache ([`kv`]): `--kv-blocks` blocks of [`BLOCK_TOKENS`] = 16
//!   tokens ([`BLOCK_BYTES`] = 64 prompt-stream bytes). Full blocks are
//!   keyed by chained xxh64 hashes seeded by the model name
//!   ([`block_hashes`]); unreferenced cached blocks are evicted LRU. A new
//!   request hits the longest run of leading cached blocks, capped by
//!   [`cacheable_hit_blocks`] (one prompt token is always computed).
//!   Output tokens fill blocks too, hashed over prompt + output bytes, and
//!   stay cached after the request ends.
//! * Scheduling ([`sched`]): one step at a time; decodes first, then
//!   prefill chunks of running requests, then waiting requests first come
//!   first served, within `--max-num-batched-tokens` and `--max-num-seqs`.
//!   When a block cannot be had, the most recently admitted request is
//!   preempted and later recomputed. A request that could never fit is
//!   refused with a 400.
//! * Step time ([`EngineConfig::step_time_us`]): fixed + per prefill token
//!   x prefill tokens + per decoding sequence (constant + per context token
//!   x context). The defaults and their sources are in [`config`]:
//!   Llama-3.1-8B-Instruct BF16 on one H100 SXM 80GB under vLLM.
//! * Time: the scheduler sleeps `step time / --time-scale` of real time per
//!   step and idles on a condition variable. Every time the engine reports
//!   (metrics, `kvroute_sim` fields) is modelled time, and modelled time is
//!   real time since start x the time scale. Keep the real step time (6 ms
//!   / scale by default) well above a sleep's granularity (~0.1 ms): when
//!   the scheduler falls more than 50 modelled ms behind the clock it
//!   restarts from the clock, and the engine then runs slower than modelled.
//! * Output: exactly `max_tokens` (or `max_completion_tokens`, default 16)
//!   tokens, as if ignore_eos; `finish_reason` is `"length"`. The text is
//!   pseudo-words of 3 lowercase letters and a space per token, a function
//!   of `--seed`, the prompt bytes and the token index only
//!   ([`generated_text`]), so every router sees identical answers.
//!
//! # HTTP
//!
//! | request | answer |
//! |---|---|
//! | `POST /v1/chat/completions`, `POST /v1/completions` | OpenAI shapes, `stream` true (SSE) or false |
//! | `GET /v1/models` | every `--model` name |
//! | `GET /health`, `GET /health_generate` | 200; 503 during `--startup-delay-ms` (real time) and an `error` fault |
//! | `GET /metrics` | Prometheus text, vLLM V1 names, labels `engine="0"`, `model_name` (first model) |
//! | `GET /get_model_info` | `{"model_path", "tokenizer_path", "is_generation": true}` |
//! | `GET /get_server_info` | `model_path`, `max_total_num_tokens`, `page_size`, `max_running_requests`, `chunked_prefill_size`, `dp_size` ... |
//! | `GET /get_load` | SGLang's shape: `[{"dp_rank":0,"num_reqs","num_waiting_reqs","num_tokens"}]` |
//! | `GET /v1/loads` | SGLang's newer shape: `{"aggregate":{"total_tokens",...},"loads":[...]}` |
//! | `POST /flush_cache` | empties the prefix cache; 200 |
//! | `GET /version` | `{"version":"kvroute-sim X.Y.Z"}` |
//! | `POST /_sim/fault` | test control, loopback peers only: `{"kind":"die"/"stall"/"error","for_s":N}` now |
//! | `POST /_sim/reset` | test control, loopback peers only: empty the cache, zero the counters |
//!
//! Non-streamed answers carry `usage` (`prompt_tokens`,
//! `completion_tokens`, `total_tokens`, `prompt_tokens_details.
//! cached_tokens`) and an extension object `kvroute_sim` with `engine`
//! (index in the fleet), `queue_ms` (arrival to first scheduled),
//! `prefill_ms` (first scheduled to first token), `e2e_ms`,
//! `cached_tokens` and `preempted` (times), all modelled. Streams send
//! `data: {json}\n\n` events in a hand-written chunked body: for chat a
//! first event with `delta.role`, then one event per token (the last has
//! `finish_reason: "length"`), then ALWAYS a final event with
//! `"choices": []`, `usage` and `kvroute_sim` (whether or not
//! `stream_options.include_usage` is set), then `data: [DONE]`. Each
//! step's events are written and flushed together.
//!
//! Errors are vLLM-style objects `{"error":{"message","type","param",
//! "code"}}`: 404 for an unknown model (``The model `X` does not
//! exist.``), 400 for invalid JSON, missing messages or prompt, a bad
//! `max_tokens`, or a request that could never fit; 413 for a body over
//! 64 MiB; 503 during an `error` fault.
//!
//! # Faults
//!
//! See [`fault`]: `die` (stop listening, cut connections), `stall` (no
//! steps, no answers for a while), `error` (503s for a while), scheduled by
//! `--fault` or applied now by `POST /_sim/fault`.

pub mod config;
pub mod fault;
mod kv;
mod metrics;
pub mod prompt;
pub mod sched;
mod server;

pub use config::EngineConfig;
pub use fault::{FaultKind, FaultSpec};
pub use kv::{BlockMap, BlockSet, Prehashed};
pub use prompt::{
    block_hashes, cacheable_hit_blocks, chat_prompt, generated_text, model_seed, tokens_of,
    BLOCK_BYTES, BLOCK_TOKENS, BYTES_PER_TOKEN,
};
pub use server::{EngineFleet, FleetConfig};
