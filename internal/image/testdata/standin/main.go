// Command standin stands in for gpudra's binaries in the image recipe's
// tests: a small Go binary whose build information records a module
// (github.com/ulikunitz/xz), which the SBOM must then list.
package main

import (
	"fmt"

	"github.com/ulikunitz/xz"
)

func main() { fmt.Println(xz.HeaderLen) }
