-- The W3C trace context of the span that enqueued a command (null when traces are off): the
-- gateway hands it to the daemon, whose span of the run joins the enqueuer's trace.
ALTER TABLE commands ADD COLUMN trace_parent text CHECK (length(trace_parent) <= 256);
