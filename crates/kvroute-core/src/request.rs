//! Request parsing: from an HTTP request to the facts routing needs.
//!
//! Four APIs are understood (see [`Endpoint`]). Bodies are parsed with serde
//! straight from the buffered bytes: strings borrow from the buffer unless
//! they carry escapes, unknown fields are skipped without being built, and
//! serde_json's recursion limit (128) answers deeply nested input with an
//! error instead of a stack overflow.
//!
//! # The canonical byte stream
//!
//! The prompt is turned into one byte stream, message after message:
//!
//! ```text
//! message  = role US part* RS
//! part     = text bytes                    (text parts, hashed)
//!          | GS kind                       (non-text parts: a marker only)
//! ```
//!
//! with `US` = 0x1F, `RS` = 0x1E, `GS` = 0x1D. Tool definitions, system
//! prompts and instructions come first, as pseudo-messages with roles
//! `tools`, `system` and `instructions`. Each message's encoding depends only
//! on that message, so the stream of a conversation's first `k` messages is a
//! byte prefix of the stream of its first `k + 1`: turn N+1 hashes to the same
//! leading blocks as turn N and finds the cache that turn N left. The property
//! test in this module checks it through JSON serialisation and parsing.
//!
//! # Affinity anchor
//!
//! The *anchor* is the end of the first `user` message: every later turn of a
//! conversation shares the bytes up to it, and two conversations that differ
//! in their first question differ before it. See [`crate::decide`] for how it
//! becomes the affinity key.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

/// The request APIs that kvroute parses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions` (OpenAI).
    ChatCompletions,
    /// `POST /v1/completions` (OpenAI legacy).
    Completions,
    /// `POST /v1/responses` (OpenAI).
    Responses,
    /// `POST /v1/messages` (Anthropic).
    Messages,
}

impl Endpoint {
    /// Maps method and path (query string ignored) to an endpoint.
    pub fn from_request(method: &str, path: &str) -> Option<Endpoint> {
        if !method.eq_ignore_ascii_case("POST") {
            return None;
        }
        let path = path.split(['?', '#']).next().unwrap_or(path);
        match path.trim_end_matches('/') {
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/responses" => Some(Endpoint::Responses),
            "/v1/messages" => Some(Endpoint::Messages),
            _ => None,
        }
    }
}

/// Byte separators of the canonical stream.
pub const UNIT_SEP: u8 = 0x1F;
pub const RECORD_SEP: u8 = 0x1E;
pub const GROUP_SEP: u8 = 0x1D;

/// Receives the canonical stream as the parsed request is walked.
pub trait CanonicalSink {
    fn bytes(&mut self, bytes: &[u8]);
    /// Called right after the first `user` message ends.
    fn anchor(&mut self);
    /// Called right before the first `user` message starts.
    fn first_user(&mut self) {}
    /// Called right before a run of messages the model produced starts (an
    /// answer, see [`Body::continues`]): the prompt of the request that
    /// produced it ends here.
    fn answer_starts(&mut self) {}
    /// Token ids given directly (`/v1/completions` with token arrays).
    fn token_ids(&mut self, ids: &[u32]);
}

/// Fields of a parsed request body that routing uses, borrowed from the body.
#[derive(Debug, Default)]
pub struct Body<'a> {
    pub model: Option<Cow<'a, str>>,
    pub max_tokens: Option<u64>,
    pub stream: bool,
    /// `prompt_cache_key` (OpenAI).
    pub prompt_cache_key: Option<Cow<'a, str>>,
    /// `user` (OpenAI) or `metadata.user_id` (Anthropic).
    pub user: Option<Cow<'a, str>>,
    /// Non-text content parts seen (images, audio, files, tool blocks).
    pub non_text_parts: u64,
    prompt: Prompt<'a>,
}

#[derive(Debug, Default)]
enum Prompt<'a> {
    #[default]
    Empty,
    Messages {
        tools: Option<&'a RawValue>,
        preamble: Vec<(&'static str, Content<'a>)>,
        messages: Vec<Message<'a>>,
    },
    Completion(Vec<PromptPiece<'a>>),
}

/// Why a body was not parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseError {
    /// Not JSON, or JSON with a wrong type or a missing required field.
    Invalid(String),
    /// The JSON nests deeper than serde_json's recursion limit.
    TooDeep,
    Empty,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParseError::Invalid(e) => write!(f, "invalid body: {e}"),
            ParseError::TooDeep => f.write_str("body nests too deeply"),
            ParseError::Empty => f.write_str("empty body"),
        }
    }
}

fn map_err(e: serde_json::Error) -> ParseError {
    let text = e.to_string();
    if text.contains("recursion limit") {
        ParseError::TooDeep
    } else {
        ParseError::Invalid(text)
    }
}

/// Parses `body` as the given endpoint's request.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Body<'_>, ParseError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ParseError::Empty);
    }
    let mut out = match endpoint {
        Endpoint::ChatCompletions => {
            let r: ChatRequest = serde_json::from_slice(body).map_err(map_err)?;
            Body {
                model: r.model,
                max_tokens: r.max_completion_tokens.or(r.max_tokens),
                stream: r.stream.unwrap_or(false),
                prompt_cache_key: r.prompt_cache_key,
                user: r.user,
                non_text_parts: 0,
                prompt: Prompt::Messages {
                    tools: r.tools,
                    preamble: Vec::new(),
                    messages: r.messages,
                },
            }
        }
        Endpoint::Completions => {
            let r: CompletionRequest = serde_json::from_slice(body).map_err(map_err)?;
            Body {
                model: r.model,
                max_tokens: r.max_tokens,
                stream: r.stream.unwrap_or(false),
                prompt_cache_key: None,
                user: r.user,
                non_text_parts: 0,
                prompt: Prompt::Completion(r.prompt.0),
            }
        }
        Endpoint::Responses => {
            let r: ResponsesRequest = serde_json::from_slice(body).map_err(map_err)?;
            let mut preamble = Vec::new();
            if let Some(i) = r.instructions {
                preamble.push(("instructions", Content::Text(i)));
            }
            let messages = match r.input {
                ResponsesInput::Text(t) => vec![Message {
                    role: Cow::Borrowed("user"),
                    content: Content::Text(t),
                    extra: None,
                }],
                ResponsesInput::Items(items) => items,
            };
            Body {
                model: r.model,
                max_tokens: r.max_output_tokens,
                stream: r.stream.unwrap_or(false),
                prompt_cache_key: r.prompt_cache_key,
                user: r.user,
                non_text_parts: 0,
                prompt: Prompt::Messages {
                    tools: r.tools,
                    preamble,
                    messages,
                },
            }
        }
        Endpoint::Messages => {
            let r: AnthropicRequest = serde_json::from_slice(body).map_err(map_err)?;
            let mut preamble = Vec::new();
            if let Some(s) = r.system {
                preamble.push(("system", s));
            }
            Body {
                model: r.model,
                max_tokens: r.max_tokens,
                stream: r.stream.unwrap_or(false),
                prompt_cache_key: None,
                user: r.metadata.and_then(|m| m.user_id),
                non_text_parts: 0,
                prompt: Prompt::Messages {
                    tools: r.tools,
                    preamble,
                    messages: r.messages,
                },
            }
        }
    };
    out.non_text_parts = out.count_non_text();
    Ok(out)
}

impl<'a> Body<'a> {
    /// Walks the prompt in canonical order, feeding `sink`.
    pub fn canonical(&self, sink: &mut dyn CanonicalSink) {
        match &self.prompt {
            Prompt::Empty => {}
            Prompt::Messages {
                tools,
                preamble,
                messages,
            } => {
                if let Some(tools) = tools {
                    write_message(sink, b"tools", |s| s.bytes(tools.get().as_bytes()));
                }
                for (role, content) in preamble {
                    write_message(sink, role.as_bytes(), |s| content.write(s));
                }
                let mut anchored = false;
                let mut answering = false;
                for m in messages {
                    if !anchored && m.role == "user" {
                        sink.first_user();
                    }
                    let answer = produced(&m.role);
                    if answer && !answering {
                        sink.answer_starts();
                    }
                    answering = answer;
                    write_message(sink, m.role.as_bytes(), |s| {
                        m.content.write(s);
                        if let Some(extra) = m.extra {
                            s.bytes(&[GROUP_SEP]);
                            s.bytes(extra.get().as_bytes());
                        }
                    });
                    if !anchored && m.role == "user" {
                        sink.anchor();
                        anchored = true;
                    }
                }
            }
            Prompt::Completion(pieces) => {
                for p in pieces {
                    match p {
                        PromptPiece::Text(t) => sink.bytes(t.as_bytes()),
                        PromptPiece::Tokens(ids) => sink.token_ids(ids),
                    }
                }
            }
        }
    }

    /// Whether the prompt continues a conversation: it holds a turn the
    /// model produced (see [`produced`]), so an earlier request of the
    /// conversation was served. A bare prompt (`/v1/completions`) does not
    /// say, and counts as not continuing.
    pub fn continues(&self) -> bool {
        match &self.prompt {
            Prompt::Messages { messages, .. } => messages.iter().any(|m| produced(&m.role)),
            Prompt::Empty | Prompt::Completion(_) => false,
        }
    }

    fn count_non_text(&self) -> u64 {
        match &self.prompt {
            Prompt::Messages {
                preamble, messages, ..
            } => {
                preamble.iter().map(|(_, c)| c.non_text()).sum::<u64>()
                    + messages.iter().map(|m| m.content.non_text()).sum::<u64>()
            }
            _ => 0,
        }
    }
}

/// A message the model produced: an answer (`assistant`), or a Responses
/// item of an answer (`function_call`, `reasoning`).
fn produced(role: &str) -> bool {
    matches!(role, "assistant" | "function_call" | "reasoning")
}

/// Canonical bytes of a `user` message's header ([`write_message`]: the
/// role, then [`UNIT_SEP`]): where its text starts.
pub const USER_HEADER: u64 = b"user".len() as u64 + 1;

fn write_message(
    sink: &mut dyn CanonicalSink,
    role: &[u8],
    body: impl FnOnce(&mut dyn CanonicalSink),
) {
    sink.bytes(role);
    sink.bytes(&[UNIT_SEP]);
    body(sink);
    sink.bytes(&[RECORD_SEP]);
}

// ---------------------------------------------------------------------------
// Wire types. Unknown fields are ignored (serde's default); only what routing
// needs is kept.

#[derive(Deserialize)]
struct ChatRequest<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow)]
    messages: Vec<Message<'a>>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct CompletionRequest<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow)]
    prompt: CompletionPrompt<'a>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct ResponsesRequest<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    instructions: Option<Cow<'a, str>>,
    #[serde(borrow)]
    input: ResponsesInput<'a>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct AnthropicRequest<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    system: Option<Content<'a>>,
    #[serde(borrow)]
    messages: Vec<Message<'a>>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(borrow, default)]
    metadata: Option<AnthropicMetadata<'a>>,
}

#[derive(Deserialize)]
struct AnthropicMetadata<'a> {
    #[serde(borrow, default)]
    user_id: Option<Cow<'a, str>>,
}

/// A string borrowed from the body unless it has escapes. (serde's own
/// `Cow<str>` always copies, outside a derived field marked `borrow`: every
/// key, role and text part used to be an allocation and a copy.)
struct CowStr<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for CowStr<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = CowStr<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(CowStr(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(CowStr(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(CowStr(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V(std::marker::PhantomData))
    }
}

/// One chat message, Responses input item, or Anthropic message.
#[derive(Debug)]
struct Message<'a> {
    /// `role`, or for Responses items without one, the item `type`.
    role: Cow<'a, str>,
    content: Content<'a>,
    /// Structured content hashed as raw JSON: `tool_calls` (chat),
    /// `arguments` / `output` (Responses function items).
    extra: Option<&'a RawValue>,
}

impl<'de: 'a, 'a> Deserialize<'de> for Message<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(MessageVisitor(std::marker::PhantomData))
    }
}

struct MessageVisitor<'a>(std::marker::PhantomData<&'a ()>);

impl<'de: 'a, 'a> Visitor<'de> for MessageVisitor<'a> {
    type Value = Message<'a>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a message object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut role: Option<Cow<'a, str>> = None;
        let mut kind: Option<Cow<'a, str>> = None;
        let mut content = Content::None;
        let mut extra: Option<&'a RawValue> = None;
        while let Some(CowStr(key)) = map.next_key::<CowStr<'de>>()? {
            match key.as_ref() {
                "role" => role = Some(map.next_value::<CowStr<'de>>()?.0),
                "type" => kind = Some(map.next_value::<CowStr<'de>>()?.0),
                "content" => content = map.next_value()?,
                // Responses function_call_output carries its text in `output`.
                "output" => content = map.next_value()?,
                "tool_calls" | "arguments" => extra = Some(map.next_value()?),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let role = role
            .or(kind)
            .ok_or_else(|| de::Error::missing_field("role"))?;
        Ok(Message {
            role,
            content,
            extra,
        })
    }
}

/// Message content: a string, or an array of typed parts, or null.
#[derive(Debug, Default)]
enum Content<'a> {
    #[default]
    None,
    Text(Cow<'a, str>),
    Parts(Vec<Part<'a>>),
}

#[derive(Debug)]
enum Part<'a> {
    Text(Cow<'a, str>),
    /// A non-text part, by its `type` (image_url, input_audio, tool_use, ...).
    Other(Cow<'a, str>),
}

impl Content<'_> {
    fn write(&self, s: &mut dyn CanonicalSink) {
        match self {
            Content::None => {}
            Content::Text(t) => s.bytes(t.as_bytes()),
            Content::Parts(parts) => {
                for p in parts {
                    match p {
                        Part::Text(t) => s.bytes(t.as_bytes()),
                        Part::Other(kind) => {
                            s.bytes(&[GROUP_SEP]);
                            s.bytes(kind.as_bytes());
                        }
                    }
                }
            }
        }
    }

    fn non_text(&self) -> u64 {
        match self {
            Content::Parts(p) => p.iter().filter(|p| matches!(p, Part::Other(_))).count() as u64,
            _ => 0,
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Content<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, an array of content parts, or null")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Owned(v)))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Content::None)
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Content::None)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::new();
                while let Some(p) = seq.next_element::<Part<'a>>()? {
                    parts.push(p);
                }
                Ok(Content::Parts(parts))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Part<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Part<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a content part object or string")
            }
            // Some clients send bare strings inside a parts array.
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Part::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Part::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut kind: Option<Cow<'a, str>> = None;
                let mut text: Option<Cow<'a, str>> = None;
                while let Some(CowStr(key)) = map.next_key::<CowStr<'de>>()? {
                    match key.as_ref() {
                        "type" => kind = Some(map.next_value::<CowStr<'de>>()?.0),
                        "text" => text = Some(map.next_value::<CowStr<'de>>()?.0),
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                // A part is text when it has a `text` string and its type is
                // one of the text kinds (or absent).
                let is_text = matches!(
                    kind.as_deref(),
                    None | Some("text") | Some("input_text") | Some("output_text")
                );
                match (text, is_text) {
                    (Some(t), true) => Ok(Part::Text(t)),
                    _ => Ok(Part::Other(kind.unwrap_or(Cow::Borrowed("unknown")))),
                }
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

#[derive(Debug)]
enum ResponsesInput<'a> {
    Text(Cow<'a, str>),
    Items(Vec<Message<'a>>),
}

impl<'de: 'a, 'a> Deserialize<'de> for ResponsesInput<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = ResponsesInput<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of input items")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(ResponsesInput::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(ResponsesInput::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::new();
                while let Some(m) = seq.next_element::<Message<'a>>()? {
                    items.push(m);
                }
                Ok(ResponsesInput::Items(items))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

#[derive(Debug)]
enum PromptPiece<'a> {
    Text(Cow<'a, str>),
    Tokens(Vec<u32>),
}

/// `prompt`: a string, an array of strings, an array of token ids, or an
/// array of token-id arrays.
struct CompletionPrompt<'a>(Vec<PromptPiece<'a>>);

impl<'de: 'a, 'a> Deserialize<'de> for CompletionPrompt<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Outer<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for Outer<'a> {
            type Value = CompletionPrompt<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, an array of strings, or token ids")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(CompletionPrompt(vec![PromptPiece::Text(Cow::Borrowed(v))]))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(CompletionPrompt(vec![PromptPiece::Text(Cow::Owned(
                    v.to_owned(),
                ))]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut pieces: Vec<PromptPiece<'a>> = Vec::new();
                while let Some(item) = seq.next_element::<PromptItem<'a>>()? {
                    match item {
                        PromptItem::Text(t) => pieces.push(PromptPiece::Text(t)),
                        PromptItem::Token(id) => match pieces.last_mut() {
                            Some(PromptPiece::Tokens(ids)) => ids.push(id),
                            _ => pieces.push(PromptPiece::Tokens(vec![id])),
                        },
                        PromptItem::Tokens(ids) => pieces.push(PromptPiece::Tokens(ids)),
                    }
                }
                Ok(CompletionPrompt(pieces))
            }
        }
        d.deserialize_any(Outer(std::marker::PhantomData))
    }
}

enum PromptItem<'a> {
    Text(Cow<'a, str>),
    Token(u32),
    Tokens(Vec<u32>),
}

impl<'de: 'a, 'a> Deserialize<'de> for PromptItem<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = PromptItem<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, a token id, or an array of token ids")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(PromptItem::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(PromptItem::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                u32::try_from(v)
                    .map(PromptItem::Token)
                    .map_err(|_| E::custom("token id out of range"))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut ids = Vec::new();
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(PromptItem::Tokens(ids))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Default)]
    struct Collect {
        bytes: Vec<u8>,
        anchor: Option<usize>,
        ids: Vec<u32>,
    }

    impl CanonicalSink for Collect {
        fn bytes(&mut self, b: &[u8]) {
            self.bytes.extend_from_slice(b);
        }
        fn anchor(&mut self) {
            self.anchor.get_or_insert(self.bytes.len());
        }
        fn token_ids(&mut self, ids: &[u32]) {
            self.ids.extend_from_slice(ids);
        }
    }

    fn canon(ep: Endpoint, json: &str) -> (Body<'_>, Collect) {
        let b = parse(ep, json.as_bytes()).unwrap();
        let mut c = Collect::default();
        b.canonical(&mut c);
        (b, c)
    }

    #[test]
    fn a_turn_the_model_produced_marks_a_continuation() {
        let cases: &[(Endpoint, &str, bool)] = &[
            (
                Endpoint::ChatCompletions,
                r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"q"}]}"#,
                false,
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"},{"role":"user","content":"q2"}]}"#,
                true,
            ),
            (
                Endpoint::Messages,
                r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"},{"role":"user","content":"q2"}]}"#,
                true,
            ),
            (
                Endpoint::Messages,
                r#"{"model":"m","max_tokens":5,"system":"s","messages":[{"role":"user","content":"q"}]}"#,
                false,
            ),
            (Endpoint::Responses, r#"{"input":"q"}"#, false),
            (
                Endpoint::Responses,
                r#"{"input":[{"role":"user","content":"q"},{"type":"function_call","name":"f","arguments":"{}","call_id":"c"},{"type":"function_call_output","call_id":"c","output":"r"}]}"#,
                true,
            ),
            (
                Endpoint::Completions,
                r#"{"prompt":"User: q\nAssistant: a\nUser: q2"}"#,
                false,
            ),
        ];
        for (ep, json, continues) in cases {
            let body = parse(*ep, json.as_bytes()).unwrap();
            assert_eq!(body.continues(), *continues, "{json}");
        }
    }

    #[test]
    fn endpoints_by_method_and_path() {
        assert_eq!(
            Endpoint::from_request("POST", "/v1/chat/completions?x=1"),
            Some(Endpoint::ChatCompletions)
        );
        assert_eq!(
            Endpoint::from_request("post", "/v1/messages"),
            Some(Endpoint::Messages)
        );
        assert_eq!(Endpoint::from_request("GET", "/v1/chat/completions"), None);
        assert_eq!(Endpoint::from_request("POST", "/v1/models"), None);
        assert_eq!(Endpoint::from_request("POST", ""), None);
    }

    #[test]
    fn chat_fields_and_parts() {
        let json = r#"{"model":"m","max_tokens":7,"stream":true,"user":"u","prompt_cache_key":"p",
            "tools":[{"type":"function","function":{"name":"f"}}],
            "messages":[{"role":"system","content":"sys"},
                        {"role":"user","content":[{"type":"text","text":"hi "},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"there"}]},
                        {"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}],
            "unknown":{"deep":[1,2,3]}}"#;
        let (b, c) = canon(Endpoint::ChatCompletions, json);
        assert_eq!(b.model.as_deref(), Some("m"));
        assert_eq!(b.max_tokens, Some(7));
        assert!(b.stream);
        assert_eq!(b.user.as_deref(), Some("u"));
        assert_eq!(b.prompt_cache_key.as_deref(), Some("p"));
        assert_eq!(b.non_text_parts, 1);
        let text = String::from_utf8_lossy(&c.bytes).into_owned();
        assert!(text.starts_with("tools\u{1f}[{\"type\""), "{text:?}");
        assert!(text.contains("system\u{1f}sys\u{1e}"));
        assert!(text.contains("user\u{1f}hi \u{1d}image_urlthere\u{1e}"));
        assert!(text.ends_with("assistant\u{1f}\u{1d}[{\"id\":\"1\"}]\u{1e}"));
        let anchor = c.anchor.unwrap();
        assert!(text[..anchor].ends_with("there\u{1e}"));
    }

    #[test]
    fn max_completion_tokens_wins_over_max_tokens() {
        let b = parse(
            Endpoint::ChatCompletions,
            br#"{"messages":[],"max_tokens":5,"max_completion_tokens":9}"#,
        )
        .unwrap();
        assert_eq!(b.max_tokens, Some(9));
    }

    #[test]
    fn escaped_strings_are_decoded() {
        let (_, c) = canon(
            Endpoint::ChatCompletions,
            r#"{"messages":[{"role":"user","content":"a\"b\u00e9"}]}"#,
        );
        assert_eq!(c.bytes, "user\u{1f}a\"b\u{e9}\u{1e}".as_bytes());
    }

    #[test]
    fn escaped_keys_roles_and_parts_read_as_plain_ones() {
        // Keys, roles, part types and part texts are borrowed from the body
        // when they have no escapes and decoded when they do; both forms
        // must give the same canonical stream.
        let plain =
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi there"}]}]}"#;
        let escaped = r#"{"messages":[{"r\u006fle":"us\u0065r","c\u006fntent":[{"typ\u0065":"t\u0065xt","t\u0065xt":"hi\u0020there"}]}]}"#;
        assert!(escaped.contains(r"\u006f") && escaped != plain);
        let (_, a) = canon(Endpoint::ChatCompletions, plain);
        let (_, b) = canon(Endpoint::ChatCompletions, escaped);
        assert_eq!(a.bytes, "user\u{1f}hi there\u{1e}".as_bytes());
        assert_eq!(a.bytes, b.bytes);
        // A key or role that is not a string is still an error, not a panic.
        for bad in [
            r#"{"messages":[{"role":7,"content":"x"}]}"#,
            r#"{"messages":[{"role":"user","content":[{"type":1,"text":"x"}]}]}"#,
        ] {
            assert!(
                parse(Endpoint::ChatCompletions, bad.as_bytes()).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn completions_prompt_forms() {
        let (_, c) = canon(Endpoint::Completions, r#"{"prompt":"abc"}"#);
        assert_eq!(c.bytes, b"abc");
        let (_, c) = canon(Endpoint::Completions, r#"{"prompt":["ab","cd"]}"#);
        assert_eq!(c.bytes, b"abcd");
        let (_, c) = canon(Endpoint::Completions, r#"{"prompt":[1,2,3]}"#);
        assert_eq!(c.ids, vec![1, 2, 3]);
        let (_, c) = canon(Endpoint::Completions, r#"{"prompt":[[1,2],[3]]}"#);
        assert_eq!(c.ids, vec![1, 2, 3]);
        assert!(parse(Endpoint::Completions, br#"{"prompt":[-1]}"#).is_err());
        assert!(parse(Endpoint::Completions, br#"{"prompt":[99999999999]}"#).is_err());
        assert!(parse(Endpoint::Completions, br#"{"prompt":{}}"#).is_err());
    }

    #[test]
    fn responses_forms() {
        let (b, c) = canon(
            Endpoint::Responses,
            r#"{"model":"m","instructions":"be nice","input":"hello","max_output_tokens":3,"prompt_cache_key":"k"}"#,
        );
        assert_eq!(b.max_tokens, Some(3));
        assert_eq!(b.prompt_cache_key.as_deref(), Some("k"));
        assert_eq!(
            c.bytes,
            "instructions\u{1f}be nice\u{1e}user\u{1f}hello\u{1e}".as_bytes()
        );
        let (_, c) = canon(
            Endpoint::Responses,
            r#"{"input":[{"role":"user","content":[{"type":"input_text","text":"q"},{"type":"input_image","image_url":"u"}]},
                         {"type":"function_call","name":"f","arguments":"{}","call_id":"c"},
                         {"type":"function_call_output","call_id":"c","output":"42"}]}"#,
        );
        assert_eq!(
            c.bytes,
            "user\u{1f}q\u{1d}input_image\u{1e}function_call\u{1f}\u{1d}\"{}\"\u{1e}function_call_output\u{1f}42\u{1e}".as_bytes()
        );
    }

    #[test]
    fn anthropic_forms() {
        let (b, c) = canon(
            Endpoint::Messages,
            r#"{"model":"claude","max_tokens":100,"system":[{"type":"text","text":"S"}],"metadata":{"user_id":"u1"},
                "messages":[{"role":"user","content":"Q"},{"role":"assistant","content":[{"type":"text","text":"A"},{"type":"tool_use","id":"t","name":"n","input":{}}]}]}"#,
        );
        assert_eq!(b.user.as_deref(), Some("u1"));
        assert_eq!(b.max_tokens, Some(100));
        assert_eq!(b.non_text_parts, 1);
        assert_eq!(
            c.bytes,
            "system\u{1f}S\u{1e}user\u{1f}Q\u{1e}assistant\u{1f}A\u{1d}tool_use\u{1e}".as_bytes()
        );
    }

    #[test]
    fn bad_bodies_are_errors_not_panics() {
        let cases: &[(&[u8], &str)] = &[
            (b"", "empty"),
            (b"   ", "empty"),
            (b"{", "invalid"),
            (b"[]", "invalid"),
            (b"null", "invalid"),
            (br#"{"messages":5}"#, "invalid"),
            (br#"{"messages":[{"content":"no role"}]}"#, "invalid"),
            (br#"{"model":{},"messages":[]}"#, "invalid"),
            (br#"{"messages":[],"max_tokens":"9"}"#, "invalid"),
            (br#"{"messages":[],"max_tokens":-1}"#, "invalid"),
            (br#"{"messages":[{"role":"user","content":7}]}"#, "invalid"),
            (b"\xff\xfe{}", "invalid"),
            (
                br#"{"messages":[{"role":"user","content":"\ud800"}]}"#,
                "invalid",
            ),
        ];
        for (body, want) in cases {
            let got = match parse(Endpoint::ChatCompletions, body) {
                Err(ParseError::Empty) => "empty",
                Err(ParseError::Invalid(_)) => "invalid",
                Err(ParseError::TooDeep) => "deep",
                Ok(_) => "ok",
            };
            assert_eq!(got, *want, "{}", String::from_utf8_lossy(body));
        }
        // Nesting inside skipped fields is walked without recursion, so
        // neither form below can overflow the stack: unclosed is invalid,
        // closed is simply ignored.
        let open = "[".repeat(100_000);
        let deep = format!("{{\"messages\":[{{\"role\":\"user\",\"content\":[{{\"x\":{open}");
        assert!(matches!(
            parse(Endpoint::ChatCompletions, deep.as_bytes()),
            Err(ParseError::Invalid(_))
        ));
        let closed = format!("{{\"messages\":[],\"x\":{open}{}}}", "]".repeat(100_000));
        assert!(parse(Endpoint::ChatCompletions, closed.as_bytes()).is_ok());
    }

    fn message() -> impl Strategy<Value = serde_json::Value> {
        let text = "[ -~\u{e9}\u{4e2d}\"\\\\\n]{0,40}";
        let part = prop_oneof![
            text.prop_map(|t| serde_json::json!({"type": "text", "text": t})),
            Just(serde_json::json!({"type": "image_url", "image_url": {"url": "http://x"}})),
        ];
        let content = prop_oneof![
            text.prop_map(serde_json::Value::from),
            prop::collection::vec(part, 0..4).prop_map(serde_json::Value::from),
        ];
        (
            prop_oneof![
                Just("system"),
                Just("user"),
                Just("assistant"),
                Just("tool")
            ],
            content,
        )
            .prop_map(|(role, content)| serde_json::json!({"role": role, "content": content}))
    }

    proptest! {
        /// The canonical stream of a conversation's first k messages is a
        /// byte prefix of that of its first k+1, through JSON and parsing.
        #[test]
        fn canonical_stream_is_prefix_stable(msgs in prop::collection::vec(message(), 1..8), k in 0usize..8) {
            let k = k % msgs.len();
            let enc = |ms: &[serde_json::Value], ep: Endpoint| {
                let body = match ep {
                    Endpoint::ChatCompletions => serde_json::json!({"model": "m", "messages": ms, "max_tokens": 5}),
                    _ => serde_json::json!({"model": "m", "system": "s", "messages": ms, "max_tokens": 5}),
                };
                let text = serde_json::to_vec(&body).unwrap();
                let b = parse(ep, &text).unwrap();
                let mut c = Collect::default();
                b.canonical(&mut c);
                c.bytes
            };
            for ep in [Endpoint::ChatCompletions, Endpoint::Messages] {
                let short = enc(&msgs[..k], ep);
                let long = enc(&msgs[..k + 1], ep);
                prop_assert!(long.starts_with(&short));
                prop_assert!(long.len() > short.len());
            }
        }

        /// Arbitrary bytes never panic the parser.
        #[test]
        fn arbitrary_bytes_never_panic(body in prop::collection::vec(any::<u8>(), 0..256)) {
            for ep in [Endpoint::ChatCompletions, Endpoint::Completions, Endpoint::Responses, Endpoint::Messages] {
                if let Ok(b) = parse(ep, &body) {
                    b.canonical(&mut Collect::default());
                }
            }
        }
    }
}
