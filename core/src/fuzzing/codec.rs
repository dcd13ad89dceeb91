/// Fuzz entry point (being written).
pub fn codec_request(_data: &[u8]) {}
/// Fuzz entry point (being written).
pub fn codec_response(_data: &[u8]) {}
