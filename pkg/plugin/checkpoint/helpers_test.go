package checkpoint

import (
	"hash/crc32"
	"strconv"
)

func crc(s string) uint32  { return crc32.ChecksumIEEE([]byte(s)) }
func itoa(v uint32) string { return strconv.FormatUint(uint64(v), 10) }
