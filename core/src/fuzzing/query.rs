/// Fuzz entry point (being written).
pub fn query(_data: &[u8]) {}
