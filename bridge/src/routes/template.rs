//! `*` wildcard patterns and `{placeholder}` templates: what routes match
//! on and how they name destinations. Parsed (and checked) once from the
//! configuration.

use ojs_core::envelope;

/// A placeholder of a [`Template`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateVar {
    /// grpcq topic.
    Topic,
    /// grpcq action.
    Action,
    /// OJS job type (for calls: `{topic}.{action}`).
    Type,
    /// The queue the message came from (for jobs: the job's queue).
    Queue,
    /// grpcq originator.
    Originator,
}

impl TemplateVar {
    /// Every placeholder.
    pub const ALL: &'static [TemplateVar] = &[
        TemplateVar::Topic,
        TemplateVar::Action,
        TemplateVar::Type,
        TemplateVar::Queue,
        TemplateVar::Originator,
    ];

    /// The placeholder's name, without braces.
    pub fn name(self) -> &'static str {
        match self {
            TemplateVar::Topic => "topic",
            TemplateVar::Action => "action",
            TemplateVar::Type => "type",
            TemplateVar::Queue => "queue",
            TemplateVar::Originator => "originator",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Var(TemplateVar),
}

/// A string with `{placeholders}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    pieces: Vec<Piece>,
}

/// Values of the placeholders for one message.
#[derive(Debug, Clone, Copy)]
pub struct Vars<'a> {
    /// grpcq topic.
    pub topic: &'a str,
    /// grpcq action.
    pub action: &'a str,
    /// OJS type; empty for calls (rendered as `{topic}.{action}`).
    pub job_type: &'a str,
    /// Source queue or job queue.
    pub queue: &'a str,
    /// grpcq originator.
    pub originator: &'a str,
}

impl Template {
    /// Parses `text`, allowing the placeholders in `allowed`.
    pub fn parse(text: &str, allowed: &[TemplateVar]) -> Result<Template, String> {
        let mut pieces = Vec::new();
        let mut rest = text;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                pieces.push(Piece::Text(rest[..open].to_owned()));
            }
            let Some(close) = rest[open..].find('}') else {
                return Err(format!("{text:?}: `{{` without `}}`"));
            };
            let name = &rest[open + 1..open + close];
            let var = allowed.iter().find(|v| v.name() == name).ok_or_else(|| {
                format!(
                    "{text:?}: unknown placeholder {{{name}}} (known: {})",
                    allowed
                        .iter()
                        .map(|v| format!("{{{}}}", v.name()))
                        .collect::<Vec<_>>()
                        .join(" ")
                )
            })?;
            pieces.push(Piece::Var(*var));
            rest = &rest[open + close + 1..];
        }
        if rest.contains('}') {
            return Err(format!("{text:?}: `}}` without `{{`"));
        }
        if !rest.is_empty() {
            pieces.push(Piece::Text(rest.to_owned()));
        }
        Ok(Template { pieces })
    }

    /// The text, when the template has no placeholder.
    pub fn as_literal(&self) -> Option<String> {
        let mut out = String::new();
        for piece in &self.pieces {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::Var(_) => return None,
            }
        }
        Some(out)
    }

    /// The text with each placeholder replaced by `f(placeholder)`.
    pub fn render_with(&self, f: impl Fn(TemplateVar) -> String) -> String {
        let mut out = String::new();
        for piece in &self.pieces {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::Var(v) => out.push_str(&f(*v)),
            }
        }
        out
    }

    /// The placeholders it uses.
    pub fn vars(&self) -> impl Iterator<Item = TemplateVar> + '_ {
        self.pieces.iter().filter_map(|p| match p {
            Piece::Var(v) => Some(*v),
            Piece::Text(_) => None,
        })
    }

    /// The literal text between placeholders.
    pub fn literal_pieces(&self) -> impl Iterator<Item = &str> {
        self.pieces.iter().filter_map(|p| match p {
            Piece::Text(t) => Some(t.as_str()),
            Piece::Var(_) => None,
        })
    }

    /// The text for one message as an OJS job type: grpcq names (`{topic}`,
    /// `{action}`, `{originator}`) go in as lowercase snake_case segments
    /// (`payment.PaymentService` → `payment.payment_service`), so a type
    /// template of valid literal text renders a valid type.
    pub fn render_type(&self, vars: &Vars<'_>) -> String {
        let mut out = String::new();
        let snake = |out: &mut String, name: &str| {
            for (i, seg) in name.split('.').enumerate() {
                if i > 0 {
                    out.push('.');
                }
                envelope::push_snake_segment(out, seg);
            }
        };
        for piece in &self.pieces {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::Var(TemplateVar::Topic) => snake(&mut out, vars.topic),
                Piece::Var(TemplateVar::Action) => snake(&mut out, vars.action),
                Piece::Var(TemplateVar::Originator) => snake(&mut out, vars.originator),
                Piece::Var(TemplateVar::Type) if vars.job_type.is_empty() => {
                    out.push_str(&envelope::type_from_topic_action(vars.topic, vars.action));
                }
                Piece::Var(TemplateVar::Type) => out.push_str(vars.job_type),
                Piece::Var(TemplateVar::Queue) => out.push_str(vars.queue),
            }
        }
        out
    }

    /// The text for one message.
    pub fn render(&self, vars: &Vars<'_>) -> String {
        let mut out = String::new();
        for piece in &self.pieces {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::Var(TemplateVar::Topic) => out.push_str(vars.topic),
                Piece::Var(TemplateVar::Action) => out.push_str(vars.action),
                Piece::Var(TemplateVar::Type) if vars.job_type.is_empty() => {
                    out.push_str(&envelope::type_from_topic_action(vars.topic, vars.action));
                }
                Piece::Var(TemplateVar::Type) => out.push_str(vars.job_type),
                Piece::Var(TemplateVar::Queue) => out.push_str(vars.queue),
                Piece::Var(TemplateVar::Originator) => out.push_str(vars.originator),
            }
        }
        out
    }
}
