//! A Server-Sent Events parser (the WHATWG `text/event-stream` format) over bytes: a chunk may end
//! inside a line or inside a multibyte character, and an event is decoded only once its blank line
//! has arrived, so neither is ever split. Lines end in LF, CRLF or CR; `data` lines join with LF;
//! comments (`:`) are skipped; a line longer than [`MAX_LINE_BYTES`] is an error, not a growing
//! buffer.

/// The longest line accepted.
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// One event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Its `id`, if it had one.
    pub id: Option<String>,
    /// Its `event` type (`message` when none was given).
    pub event: String,
    /// Its `data` lines, joined with LF.
    pub data: String,
}

/// The parser's state between chunks.
#[derive(Debug, Default)]
pub struct Parser {
    line: Vec<u8>,
    /// The last byte was a CR (a CRLF's LF may come in the next chunk).
    after_cr: bool,
    id: Option<String>,
    event: Option<String>,
    data: Option<String>,
}

impl Parser {
    /// Feeds `chunk`; returns the events it completed, in order.
    pub fn push(&mut self, chunk: &[u8]) -> anyhow::Result<Vec<Event>> {
        let mut done = Vec::new();
        for &b in chunk {
            if std::mem::take(&mut self.after_cr) && b == b'\n' {
                continue;
            }
            match b {
                b'\n' | b'\r' => {
                    self.after_cr = b == b'\r';
                    let line = std::mem::take(&mut self.line);
                    if let Some(e) = self.line_ended(&line) {
                        done.push(e);
                    }
                }
                _ if self.line.len() >= MAX_LINE_BYTES => anyhow::bail!("the event stream sent a line of more than {MAX_LINE_BYTES} bytes"),
                _ => self.line.push(b),
            }
        }
        Ok(done)
    }

    fn line_ended(&mut self, line: &[u8]) -> Option<Event> {
        if line.is_empty() {
            // A blank line dispatches what the event's lines gave, if any data came.
            let (id, event, data) = (self.id.take(), self.event.take(), self.data.take());
            return data.map(|mut data| {
                data.pop();
                Event { id, event: event.unwrap_or_else(|| "message".to_owned()), data }
            });
        }
        let line = String::from_utf8_lossy(line);
        if line.starts_with(':') {
            return None;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line.as_ref(), ""),
        };
        match field {
            "data" => {
                // Each line with its LF; the last LF goes at dispatch.
                let data = self.data.get_or_insert_with(String::new);
                data.push_str(value);
                data.push('\n');
            }
            "event" => self.event = Some(value.to_owned()),
            "id" if !value.contains('\0') => self.id = Some(value.to_owned()),
            _ => {}
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(chunks: &[&[u8]]) -> Vec<Event> {
        let mut p = Parser::default();
        chunks.iter().flat_map(|c| p.push(c).unwrap()).collect()
    }

    #[test]
    fn a_multibyte_character_split_across_chunks_arrives_whole() {
        let text = "id: 7\nevent: instance.console\ndata: {\"text\":\"h\u{e9}llo \u{1f600}\"}\n\n".as_bytes();
        for cut in 0..text.len() {
            let events = all(&[&text[..cut], &text[cut..]]);
            assert_eq!(events.len(), 1, "cut at {cut}");
            assert_eq!(events[0], Event { id: Some("7".into()), event: "instance.console".into(), data: "{\"text\":\"h\u{e9}llo \u{1f600}\"}".into() }, "cut at {cut}");
        }
    }

    #[test]
    fn crlf_and_cr_lines_multi_line_data_and_comments_parse_as_the_standard_says() {
        let events = all(&[b": keep-alive\r\n\r\ndata: one\r\ndata:two\r", b"\n\r\nevent: end\rdata: {}\r\r", b"data\n\n"]);
        assert_eq!(events.len(), 3);
        assert_eq!(events[0], Event { id: None, event: "message".into(), data: "one\ntwo".into() });
        assert_eq!(events[1], Event { id: None, event: "end".into(), data: "{}".into() });
        assert_eq!(events[2].data, "");
    }

    #[test]
    fn an_endless_line_is_an_error_not_a_growing_buffer() {
        let mut p = Parser::default();
        let big = vec![b'x'; MAX_LINE_BYTES];
        assert!(p.push(&big).unwrap().is_empty());
        assert!(p.push(b"y").is_err());
    }
}
