package daemontest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"time"
)

// TLS is a CA made for one test run, the daemon's certificate, and a way to issue
// client certificates: nothing is committed, nothing outlives the test directory.
type TLS struct {
	Dir    string
	CAFile string
	ca     *x509.Certificate
	caKey  *ecdsa.PrivateKey
	pool   *x509.CertPool
}

// NewTLS makes a CA and a server certificate for 127.0.0.1 and localhost in dir.
func NewTLS(dir string) (*TLS, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "daemontest CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	ca, _ := x509.ParseCertificate(der)
	t := &TLS{Dir: dir, CAFile: filepath.Join(dir, "ca.crt"), ca: ca, caKey: key, pool: x509.NewCertPool()}
	t.pool.AddCert(ca)
	if err := writePEM(t.CAFile, "CERTIFICATE", der); err != nil {
		return nil, err
	}
	if _, _, err := t.issue("server", "kvprefetchd", nil, true); err != nil {
		return nil, err
	}
	return t, nil
}

// ServerFiles are the daemon's certificate and key.
func (t *TLS) ServerFiles() (cert, key string) {
	return filepath.Join(t.Dir, "server.crt"), filepath.Join(t.Dir, "server.key")
}

// Client issues a client certificate naming uri (a SPIFFE ID, say) and returns a
// tls.Config that presents it and trusts the CA.
func (t *TLS) Client(name, uri string) (*tls.Config, error) {
	certFile, keyFile, err := t.issue(name, name, []string{uri}, false)
	if err != nil {
		return nil, err
	}
	pair, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, err
	}
	return &tls.Config{Certificates: []tls.Certificate{pair}, RootCAs: t.pool, MinVersion: tls.VersionTLS12}, nil
}

func (t *TLS) issue(stem, cn string, uris []string, server bool) (string, string, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", err
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature,
	}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.DNSNames = []string{"localhost"}
		tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("::1")}
	} else {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
		for _, u := range uris {
			parsed, err := url.Parse(u)
			if err != nil {
				return "", "", err
			}
			tmpl.URIs = append(tmpl.URIs, parsed)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, t.ca, &key.PublicKey, t.caKey)
	if err != nil {
		return "", "", err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return "", "", err
	}
	certFile, keyFile := filepath.Join(t.Dir, stem+".crt"), filepath.Join(t.Dir, stem+".key")
	if err := writePEM(certFile, "CERTIFICATE", der); err != nil {
		return "", "", err
	}
	return certFile, keyFile, writePEM(keyFile, "PRIVATE KEY", keyDER)
}

func writePEM(path, kind string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600)
}

// FreePort is a TCP port on 127.0.0.1 nobody listens on (a moment ago).
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// TCPConfig is the TOML that turns on the daemon's TLS listener on port, letting in the
// clients that name one of allowed.
func (t *TLS) TCPConfig(port int, allowed ...string) string {
	cert, key := t.ServerFiles()
	list := ""
	for i, a := range allowed {
		if i > 0 {
			list += ", "
		}
		list += fmt.Sprintf("%q", a)
	}
	return fmt.Sprintf("listen_tcp = \"127.0.0.1:%d\"\ntls_cert_file = %q\ntls_key_file = %q\ntls_client_ca_file = %q\ntls_allowed_clients = [%s]\n",
		port, cert, key, t.CAFile, list)
}
