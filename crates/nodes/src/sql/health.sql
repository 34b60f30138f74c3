-- The health circuit's row is made with its pool, however the pool is inserted, so a health run
-- always finds the row it locks (migrations/nodes/0012_pool_health_circuits.sql).
CREATE OR REPLACE FUNCTION nodes_pool_health_circuit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO pool_health_circuits (pool_id) VALUES (NEW.id);
  RETURN NULL;
END $$;

CREATE OR REPLACE TRIGGER pools_health_circuit AFTER INSERT ON pools
  FOR EACH ROW EXECUTE FUNCTION nodes_pool_health_circuit();
