/// Fuzz entry point (being written).
pub fn url(_data: &[u8]) {}
