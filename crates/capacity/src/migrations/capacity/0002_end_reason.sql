-- Why a reservation ended when neither its tenant nor its end ended it (drained: its node's drain
-- evicted it at the deadline).
ALTER TABLE reservations ADD COLUMN end_reason text CHECK (end_reason IS NULL OR end_reason IN ('drained'));
